"""Hugging Face checkpoints <-> decoder params (numpy only: relays run this on host trees).

One name map (`name_map(cfg)`) drives both directions. Each entry pairs a HF tensor name with a
path in the params pure dict (layer index for stacked per-layer params) and a pair of exact
transforms (transpose / reshape, so a round trip is bit-exact):

    model.embed_tokens.weight                  [V, E]     <-> embedding [V, E]
    model.layers.{i}.self_attn.q_proj.weight   [H*D, E]   <-> layers/q_kernel[i] [E, H, D]
    model.layers.{i}.self_attn.{k,v}_proj.weight [K*D, E] <-> layers/{k,v}_kernel[i] [E, K, D]
    model.layers.{i}.self_attn.o_proj.weight   [E, H*D]   <-> layers/o_kernel[i] [H, D, E]
    model.layers.{i}.self_attn.{q,k,v}_proj.bias          <-> layers/{q,k,v}_bias[i] [heads, D]
    model.layers.{i}.self_attn.{q,k}_norm.weight [D]      <-> layers/{q,k}_norm[i]
    model.layers.{i}.input_layernorm.weight    [E]        <-> layers/attn_norm[i]
    model.layers.{i}.post_attention_layernorm.weight      <-> layers/mlp_norm[i]
    model.layers.{i}.mlp.{gate,up}_proj.weight [M, E]     <-> layers/{gate,up}_kernel[i] [E, M]
    model.layers.{i}.mlp.down_proj.weight      [E, M]     <-> layers/down_kernel[i] [M, E]
    model.norm.weight                          [E]        <-> final_norm
    lm_head.weight                             [V, E]     <-> lm_head [E, V] (untied only)

Folder layout (as transformers writes it): `config.json` plus `model.safetensors`, or shards
`model-0000k-of-0000n.safetensors` listed in `model.safetensors.index.json`.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

import ml_dtypes
import numpy as np
from safetensors.numpy import load_file, save_file

from laminar_jax.models.config import DecoderConfig

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Buffers some exporters write; they carry no parameters.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def np_dtype(name: Any) -> np.dtype:
    """numpy dtype for a name ("bfloat16" via ml_dtypes) or a dtype."""
    if isinstance(name, str) and name == "bfloat16":
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


@dataclass(frozen=True)
class Entry:
    """One HF tensor: its name, where it lives in the params dict, and the exact transforms."""

    hf_name: str
    path: tuple[str, ...]
    layer: int | None                            # index on the stacked `layers` axis, or None
    hf_shape: tuple[int, ...]
    to_hf: Callable[[np.ndarray], np.ndarray]    # param slice -> HF tensor
    from_hf: Callable[[np.ndarray], np.ndarray]  # HF tensor -> param slice


def _t(x):
    return x.T


def name_map(cfg: DecoderConfig) -> list[Entry]:
    """The single HF <-> params name map for `cfg` (order = HF's module order)."""
    e, h, k, d, m, v = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                        cfg.intermediate_size, cfg.vocab_size)

    def in_proj(heads):  # [E, heads, D] <-> [heads*D, E]
        return (lambda x: x.reshape(e, heads * d).T, lambda w: w.T.reshape(e, heads, d))

    def bias(heads):  # [heads, D] <-> [heads*D]
        return (lambda x: x.reshape(heads * d), lambda w: w.reshape(heads, d))

    ident = (lambda x: x, lambda w: w)
    out = [Entry("model.embed_tokens.weight", ("embedding",), None, (v, e), *ident)]
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}."
        layer = [
            ("input_layernorm.weight", "attn_norm", (e,), ident),
            ("self_attn.q_proj.weight", "q_kernel", (h * d, e), in_proj(h)),
            ("self_attn.k_proj.weight", "k_kernel", (k * d, e), in_proj(k)),
            ("self_attn.v_proj.weight", "v_kernel", (k * d, e), in_proj(k)),
        ]
        if cfg.qkv_bias:
            layer += [("self_attn.q_proj.bias", "q_bias", (h * d,), bias(h)),
                      ("self_attn.k_proj.bias", "k_bias", (k * d,), bias(k)),
                      ("self_attn.v_proj.bias", "v_bias", (k * d,), bias(k))]
        layer.append(("self_attn.o_proj.weight", "o_kernel", (e, h * d),
                      (lambda x: x.reshape(h * d, e).T, lambda w: w.T.reshape(h, d, e))))
        if cfg.qk_norm:
            layer += [("self_attn.q_norm.weight", "q_norm", (d,), ident),
                      ("self_attn.k_norm.weight", "k_norm", (d,), ident)]
        layer += [
            ("post_attention_layernorm.weight", "mlp_norm", (e,), ident),
            ("mlp.gate_proj.weight", "gate_kernel", (m, e), (_t, _t)),
            ("mlp.up_proj.weight", "up_kernel", (m, e), (_t, _t)),
            ("mlp.down_proj.weight", "down_kernel", (e, m), (_t, _t)),
        ]
        out += [Entry(pre + name, ("layers", key), i, shape, *fns) for name, key, shape, fns in layer]
    out.append(Entry("model.norm.weight", ("final_norm",), None, (e,), *ident))
    if not cfg.tie_word_embeddings:
        out.append(Entry("lm_head.weight", ("lm_head",), None, (v, e), _t, _t))
    return out


def _as_pure_dict(params: Any) -> Mapping:
    # Accept an nnx.State as well as its pure dict, without importing flax.
    return params.to_pure_dict() if hasattr(params, "to_pure_dict") else params


def _leaf(tree: Mapping, path: tuple[str, ...]) -> np.ndarray:
    node = tree
    for key in path:
        if key not in node:
            raise KeyError(f"params tree has no entry {'/'.join(path)!r}")
        node = node[key]
    return np.asarray(node)


def params_to_hf(cfg: DecoderConfig, params: Any, dtype: Any = None) -> dict[str, np.ndarray]:
    """HF-named, HF-shaped numpy tensors from a params tree (numpy or jax leaves).

    `dtype` (e.g. "bfloat16" for the rollout copy) casts every tensor; None keeps each dtype.
    """
    tree = _as_pure_dict(params)
    target = None if dtype is None else np_dtype(dtype)
    out: dict[str, np.ndarray] = {}
    leaves: dict[tuple[str, ...], np.ndarray] = {}
    for entry in name_map(cfg):
        if entry.path not in leaves:
            leaves[entry.path] = _leaf(tree, entry.path)
        value = leaves[entry.path]
        if entry.layer is not None:
            value = value[entry.layer]
        tensor = np.ascontiguousarray(entry.to_hf(value))
        if tensor.shape != entry.hf_shape:
            raise ValueError(
                f"params tree: {'/'.join(entry.path)} gives {entry.hf_name!r} of shape {tensor.shape}, "
                f"expected {entry.hf_shape}")
        out[entry.hf_name] = tensor if target is None else tensor.astype(target)
    return out


def _where(source: str | Mapping[str, str], name: str) -> str:
    if isinstance(source, Mapping):
        return source.get(name, source.get("", "checkpoint"))
    return source


def hf_to_params(cfg: DecoderConfig, tensors: Mapping[str, np.ndarray],
                 source: str | Mapping[str, str] = "checkpoint", dtype: Any = None) -> dict:
    """Params pure dict from HF-named tensors; per-layer tensors are stacked on axis 0.

    `source` names the file in errors (a str, or a map tensor name -> file with "" as fallback).
    `dtype` casts every tensor; None keeps the stored dtype (bit-exact round trip).
    Errors name the file and tensor for a missing, unexpected or mis-shaped tensor.
    """
    entries = name_map(cfg)
    expected = {entry.hf_name for entry in entries}
    extra = [n for n in tensors if n not in expected and not n.endswith(_IGNORED_SUFFIXES)]
    if cfg.tie_word_embeddings and "lm_head.weight" in extra:
        # Some exporters store the tied head explicitly; accept it only if it is the embedding.
        head, emb = tensors["lm_head.weight"], tensors.get("model.embed_tokens.weight")
        if emb is not None and np.array_equal(np.asarray(head), np.asarray(emb)):
            extra.remove("lm_head.weight")
        else:
            raise ValueError(
                f"{_where(source, 'lm_head.weight')}: tensor 'lm_head.weight' differs from "
                "'model.embed_tokens.weight' but the config has tie_word_embeddings=true")
    if extra:
        raise ValueError(
            f"{_where(source, extra[0])}: unexpected tensor {extra[0]!r} (shape "
            f"{tuple(np.shape(tensors[extra[0]]))}) for a {cfg.arch} model"
            + (f" ({len(extra)} unexpected in all)" if len(extra) > 1 else ""))
    target = None if dtype is None else np_dtype(dtype)
    slices: dict[tuple[str, ...], list] = {}
    for entry in entries:
        if entry.hf_name not in tensors:
            raise ValueError(
                f"{_where(source, entry.hf_name)}: missing tensor {entry.hf_name!r} "
                f"(expected shape {entry.hf_shape})")
        tensor = np.asarray(tensors[entry.hf_name])
        if tensor.shape != entry.hf_shape:
            raise ValueError(
                f"{_where(source, entry.hf_name)}: tensor {entry.hf_name!r} has shape {tensor.shape}, "
                f"expected {entry.hf_shape}")
        value = entry.from_hf(tensor)
        slices.setdefault(entry.path, []).append(value if target is None else value.astype(target))
    tree: dict = {}
    for path, parts in slices.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = np.stack(parts) if path[0] == "layers" else parts[0]
    return tree


# ---------------------------------------------------------------------- folders
def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: not found") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from None


def read_tensors(folder: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """All tensors of a folder (single file or sharded index) and a map name -> file path."""
    index_path = os.path.join(folder, INDEX_FILE)
    single_path = os.path.join(folder, SINGLE_FILE)
    if os.path.exists(index_path):
        weight_map = _read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index_path}: missing 'weight_map'")
        tensors, where = {}, {"": index_path}
        for shard in sorted(set(weight_map.values())):
            shard_path = os.path.join(folder, shard)
            if not os.path.exists(shard_path):
                raise FileNotFoundError(f"{index_path}: shard {shard!r} not found at {shard_path}")
            for name, value in load_file(shard_path).items():
                tensors[name] = value
                where[name] = shard_path
        listed_missing = [n for n in weight_map if n not in tensors]
        if listed_missing:
            raise ValueError(
                f"{os.path.join(folder, weight_map[listed_missing[0]])}: tensor {listed_missing[0]!r} "
                f"is listed in {index_path} but not stored in that shard")
        return tensors, where
    if os.path.exists(single_path):
        return load_file(single_path), {"": single_path}
    raise FileNotFoundError(f"{folder}: neither {SINGLE_FILE} nor {INDEX_FILE} found")


def load_pretrained(folder: str, *, param_dtype: Any = None, dtype: str | None = None,
                    ) -> tuple[DecoderConfig, dict]:
    """(config, params pure dict of numpy arrays) from a HF folder.

    `param_dtype=None` keeps the stored dtype (taken from the embedding) and records it in
    `cfg.param_dtype`; otherwise tensors are cast. `dtype` sets the compute dtype (default: the
    param dtype).
    """
    config_path = os.path.join(folder, CONFIG_FILE)
    if not os.path.exists(config_path):
        raise FileNotFoundError(f"{config_path}: not found (a Hugging Face model folder needs config.json)")
    hf_config = _read_json(config_path)
    cfg = DecoderConfig.from_hf(hf_config, source=config_path)
    tensors, where = read_tensors(folder)
    if param_dtype is None:
        stored = tensors.get("model.embed_tokens.weight")
        param_dtype = np_dtype(stored.dtype).name if stored is not None else "float32"
    param_dtype = np_dtype(param_dtype).name
    cfg = cfg.replace(param_dtype=param_dtype, dtype=dtype or param_dtype)
    params = hf_to_params(cfg, tensors, source=where, dtype=param_dtype)
    return cfg, params


def _clear_weights(folder: str) -> None:
    # Stale shards from an earlier save would be mixed into the next load; remove only our names.
    for name in os.listdir(folder):
        if name in (SINGLE_FILE, INDEX_FILE) or (
                name.startswith("model-") and "-of-" in name and name.endswith(".safetensors")):
            os.remove(os.path.join(folder, name))


def save_pretrained(folder: str, cfg: DecoderConfig, params: Any, dtype: Any = None,
                    max_shard_bytes: int | None = None, extra_config: Mapping | None = None) -> list[str]:
    """Write `config.json` + safetensors (sharded with an index past `max_shard_bytes`).

    `dtype` casts the stored tensors (None keeps them); `extra_config` adds keys to config.json
    (e.g. bos/eos token ids carried over from the source checkpoint). Returns the files written.
    """
    os.makedirs(folder, exist_ok=True)
    tensors = params_to_hf(cfg, params, dtype=dtype)
    stored = np_dtype(tensors["model.embed_tokens.weight"].dtype).name
    hf_config = {**cfg.to_hf(), "dtype": stored, **dict(extra_config or {})}
    _clear_weights(folder)
    written = [os.path.join(folder, CONFIG_FILE)]
    with open(written[0], "w") as f:
        json.dump(hf_config, f, indent=2, sort_keys=True)
        f.write("\n")
    total = sum(t.nbytes for t in tensors.values())
    metadata = {"format": "pt"}  # transformers refuses safetensors without a known format
    if max_shard_bytes is None or total <= max_shard_bytes:
        path = os.path.join(folder, SINGLE_FILE)
        save_file(tensors, path, metadata=metadata)
        return written + [path]
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        if shards[-1] and size + tensor.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += tensor.nbytes
    weight_map = {}
    for k, shard in enumerate(shards, start=1):
        shard_name = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(folder, shard_name), metadata=metadata)
        written.append(os.path.join(folder, shard_name))
        weight_map.update({name: shard_name for name in shard})
    index = {"metadata": {"total_size": int(total)}, "weight_map": weight_map}
    with open(os.path.join(folder, INDEX_FILE), "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)
        f.write("\n")
    return written + [os.path.join(folder, INDEX_FILE)]


# ---------------------------------------------------------------------- checks without loading
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2, "F16": 2,
                "BF16": 2, "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8}
_HEADER_MAX = 100 * 1024 * 1024  # the safetensors format's own cap on the JSON header


def safetensors_header(path: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{tensor name: (dtype, shape)} from a safetensors file's header, reading no tensor data.

    Checks what a truncated or foreign file gets wrong: the 8-byte header length, the JSON
    header, and that every tensor's byte range matches its shape and lies inside the file.
    ValueError naming the file otherwise.
    """
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: not a safetensors file ({size} bytes, no header)")
        n = int.from_bytes(head, "little")
        if n > min(_HEADER_MAX, size - 8):
            raise ValueError(f"{path}: not a safetensors file or truncated (header of {n} bytes in a "
                             f"{size}-byte file)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: not a safetensors file (header is not JSON: {e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: not a safetensors file (header is not a JSON object)")
    out, data_bytes = {}, size - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise ValueError(f"{path}: tensor {name!r}: malformed header entry {info!r:.100}") from None
        want = int(np.prod(shape, dtype=np.int64)) * _DTYPE_BYTES.get(dtype, 0)
        if dtype not in _DTYPE_BYTES or end - begin != want:
            raise ValueError(f"{path}: tensor {name!r}: dtype {dtype} shape {list(shape)} does not match "
                             f"its {end - begin} stored bytes")
        if end > data_bytes:
            raise ValueError(f"{path}: truncated: tensor {name!r} ends at byte {end} of the data, but the file "
                             f"holds {data_bytes} data bytes")
        out[name] = (dtype, shape)
    return out


def check_folder(folder: str) -> DecoderConfig:
    """Checks a Hugging Face folder without loading weights: config.json (architectures agreeing
    with model_type), every shard's header, and every tensor the model needs with its shape.
    Returns the config; FileNotFoundError / ValueError naming the bad file otherwise."""
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"{folder}: no such model folder")
    config_path = os.path.join(folder, CONFIG_FILE)
    if not os.path.exists(config_path):
        raise FileNotFoundError(f"{config_path}: not found (a Hugging Face model folder needs config.json)")
    hf_config = _read_json(config_path)
    if not isinstance(hf_config, dict):
        raise ValueError(f"{config_path}: expected a JSON object, got {type(hf_config).__name__}")
    from laminar_jax.models.config import ARCHITECTURES
    archs, model_type = hf_config.get("architectures") or [], hf_config.get("model_type")
    if archs and archs[0] in ARCHITECTURES and model_type is not None and model_type != ARCHITECTURES[archs[0]]:
        raise ValueError(f"{config_path}: model_type {model_type!r} contradicts architectures {archs!r} "
                         f"(which is model_type {ARCHITECTURES[archs[0]]!r})")
    cfg = DecoderConfig.from_hf(hf_config, source=config_path)
    index_path, single_path = os.path.join(folder, INDEX_FILE), os.path.join(folder, SINGLE_FILE)
    if os.path.exists(index_path):
        weight_map = _read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index_path}: missing 'weight_map'")
        files = sorted(set(weight_map.values()))
    elif os.path.exists(single_path):
        files = [SINGLE_FILE]
    else:
        raise FileNotFoundError(f"{folder}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
    shapes, where = {}, {}
    for name in files:
        path = os.path.join(folder, name)
        if not os.path.exists(path):
            raise FileNotFoundError(f"{index_path}: shard {name!r} not found at {path}")
        for tensor, (_, shape) in safetensors_header(path).items():
            shapes[tensor], where[tensor] = shape, path
    for entry in name_map(cfg):
        if entry.hf_name not in shapes:
            raise ValueError(f"{folder}: missing tensor {entry.hf_name!r} (expected shape {entry.hf_shape})")
        if shapes[entry.hf_name] != entry.hf_shape:
            raise ValueError(f"{where[entry.hf_name]}: tensor {entry.hf_name!r} has shape "
                             f"{shapes[entry.hf_name]}, expected {entry.hf_shape}")
    return cfg
