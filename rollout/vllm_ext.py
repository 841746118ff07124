"""vLLM worker extension (`EngineArgs(worker_extension_cls="rollout.vllm_ext.RolloutWorkerExtension")`).

Methods run inside vLLM's worker (`self` is the worker) through `engine.collective_rpc(name, ...)`:

- `update_weights_from_arrays(arrays, direct=True)`: Hugging Face-named numpy arrays (in-process
  engines: the arguments are not serialised), wrapped as torch tensors without a copy
  (`to_torch`: read-only views of a relay's mapped buffer included; bfloat16 through its bits)
  and copied straight into vLLM's parameters (`rollout.vllm_weights.load_in_place`); what that
  cannot place, or everything with `direct=False`, goes through the worker's `reload_weights`.
- `update_weights_from_bytes(blob)`: Hugging Face-named tensors as safetensors bytes, loaded with
  the worker's `reload_weights` (layerwise reload that re-runs vLLM-CPU's weight prepacking;
  `model.load_weights` after startup fails on CPU). Bytes, because torch tensors do not survive
  `collective_rpc` arguments in multiprocess mode.
- `install_dual_logprobs()`: wraps the sampler so that, for requests asking `logprobs=1` with the
  engine in `processed_logprobs` mode, position 0 of each token's log-probs is the sampled token
  under the distribution actually sampled from (vLLM's processed log-prob) and position 1 is the
  same token under the untruncated softmax at temperature 1 (its raw log-prob), tagged with token
  id `RAW_LOGP_TOKEN_ID`. One sampling pass gives both numbers `rollout.engine` documents.
"""
from __future__ import annotations

RAW_LOGP_TOKEN_ID = -1


def _dual_forward(original):
    import torch

    from vllm.v1.outputs import LogprobsTensors

    def forward(*args, **kwargs):
        logits = kwargs["logits"] if "logits" in kwargs else args[0]
        metadata = kwargs["sampling_metadata"] if "sampling_metadata" in kwargs else args[1]
        # The sampler scales logits in place (temperature), so take the raw ones first.
        raw = None if metadata.max_num_logprobs is None else torch.log_softmax(logits.float(), dim=-1)
        out = original(*args, **kwargs)
        tensors = out.logprobs_tensors
        if raw is None or tensors is None or tensors.logprob_token_ids.shape[-1] < 2:
            return out
        sampled = out.sampled_token_ids[:, 0].long()
        ids, lps = tensors.logprob_token_ids.clone(), tensors.logprobs.clone()
        ids[:, 1] = RAW_LOGP_TOKEN_ID
        lps[:, 1] = raw.gather(-1, sampled[:, None])[:, 0]
        out.logprobs_tensors = LogprobsTensors(ids, lps, *tensors[2:])
        return out

    return forward


def to_torch(array):
    """A torch tensor sharing `array`'s memory (numpy float/int, or ml_dtypes bfloat16 by its bits).

    A read-only array (a view of the relay's mapped buffer) is wrapped as it is: vLLM only reads
    the tensor (`param.copy_(loaded)`), so torch's "non-writable" warning is silenced here."""
    return to_torch_all({"": array})[""]


def to_torch_all(arrays) -> dict:
    """`to_torch` of every value of a name -> array mapping, under one warnings filter (entering
    `catch_warnings` per tensor was a visible part of a small model's switch)."""
    import warnings

    import numpy as np
    import torch

    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for name, array in arrays.items():
            a = np.asarray(array)
            bf16 = a.dtype.name == "bfloat16"
            t = torch.from_numpy(a.view(np.uint16) if bf16 else a)
            out[name] = t.view(torch.bfloat16) if bf16 else t
    return out


class RolloutWorkerExtension:
    """Mixed into vLLM's worker class by `worker_extension_cls`."""

    def update_weights_from_arrays(self, arrays, direct: bool = True) -> int:
        """Load HF-named numpy arrays; returns how many went the direct way (`rollout.vllm_weights`),
        the rest (all of them with `direct=False`) through `reload_weights`."""
        tensors = to_torch_all(arrays)
        left = tensors
        if direct:
            from rollout.vllm_weights import load_in_place
            left = load_in_place(self.model_runner.get_model(), tensors,
                                 tp_size=self.vllm_config.parallel_config.tensor_parallel_size)
        if left:
            self.reload_weights(weights_iterator=list(left.items()), is_checkpoint_format=True)
        return len(tensors) - len(left)

    def update_weights_from_bytes(self, blob: bytes) -> int:
        import safetensors.torch

        tensors = safetensors.torch.load(blob)
        self.reload_weights(weights_iterator=list(tensors.items()), is_checkpoint_format=True)
        return len(tensors)

    def install_dual_logprobs(self) -> bool:
        sampler = self.model_runner.sampler
        if getattr(sampler, "_laminar_dual_logprobs", False):
            return True
        if sampler.logprobs_mode != "processed_logprobs":
            raise ValueError(f"install_dual_logprobs needs logprobs_mode='processed_logprobs', the "
                             f"engine runs {sampler.logprobs_mode!r}")
        sampler.forward = _dual_forward(sampler.forward)
        sampler._laminar_dual_logprobs = True
        return True
