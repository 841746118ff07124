"""weights/flat.py: engine-layout flat buffer, index, chunk checksums (pure numpy)."""
import zlib

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from laminar_jax.models import hf
from laminar_jax.models.config import DecoderConfig
from laminar_jax.weights import flat
from laminar_jax.weights.chain import chunk_bounds


def _random_params(cfg, seed=0):
    """A params pure dict shaped like the decoder's, with random float32 values."""
    rng = np.random.default_rng(seed)
    tensors = {e.hf_name: rng.standard_normal(e.hf_shape).astype(np.float32) for e in hf.name_map(cfg)}
    return hf.hf_to_params(cfg, tensors)


@pytest.mark.parametrize("tie, workers", [(True, 1), (False, 3)])
@pytest.mark.parametrize("dtype", [None, "bfloat16", "float16"])
def test_params_to_flat_equals_flatten_of_params_to_hf(tie, workers, dtype):
    cfg = DecoderConfig.preset("tiny", tie_word_embeddings=tie, qk_norm=True)
    params = _random_params(cfg)
    buffer, index = flat.params_to_flat(cfg, params, dtype=dtype, workers=workers)
    ref_buffer, ref_index = flat.flatten(hf.params_to_hf(cfg, params, dtype=dtype))
    assert index == ref_index
    assert np.array_equal(buffer, ref_buffer)
    names = [e.hf_name for e in hf.name_map(cfg)]
    assert [e.name for e in index] == names
    assert ("lm_head.weight" in names) == (not tie)
    # the single pass casts exactly like astype (round to nearest even for bfloat16)
    views = flat.unflatten(buffer, index)
    want = hf.params_to_hf(cfg, params)["model.layers.1.mlp.down_proj.weight"]
    got = views["model.layers.1.mlp.down_proj.weight"]
    expected = want if dtype is None else want.astype(hf.np_dtype(dtype))
    assert got.dtype == expected.dtype and np.array_equal(got.view(np.uint8), expected.view(np.uint8))


def test_flat_round_trip_is_bit_exact():
    cfg = DecoderConfig.preset("tiny", tie_word_embeddings=False)
    params = _random_params(cfg, seed=3)
    buffer, index = flat.params_to_flat(cfg, params, dtype="bfloat16")
    back = flat.flat_to_params(cfg, buffer, index)
    cast = hf.hf_to_params(cfg, hf.params_to_hf(cfg, params, dtype="bfloat16"))
    leaves = dict(_flat_items(back))
    for path, value in _flat_items(cast):
        assert leaves[path].dtype == np.dtype(ml_dtypes.bfloat16)
        assert np.array_equal(leaves[path].view(np.uint16), value.view(np.uint16)), path


def _flat_items(tree, prefix=()):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _flat_items(v, prefix + (k,))
        else:
            yield prefix + (k,), v


@pytest.mark.parametrize("shape", [(130, 70), (64, 200), (3, 500), (257, 129)])
def test_tiled_transposing_copy_equals_transpose(shape):
    src = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    dst = np.empty(shape[::-1], ml_dtypes.bfloat16)
    flat._copy(dst, src.T)
    assert np.array_equal(dst.view(np.uint16), src.T.astype(ml_dtypes.bfloat16).view(np.uint16))


def test_layout_aligns_offsets_and_zeroes_padding():
    tensors = {"a": np.arange(3, dtype=np.int8), "b": np.ones((2, 3), np.float32),
               "c": np.full(5, 7, np.uint16)}
    buffer, index = flat.flatten(tensors, align=64)
    assert [e.offset for e in index] == [0, 64, 128]
    assert buffer.size == 128 + 10
    assert not buffer[3:64].any() and not buffer[64 + 24:128].any()
    views = flat.unflatten(buffer, index)
    for name, t in tensors.items():
        assert views[name].dtype == t.dtype and np.array_equal(views[name], t)
    # views share memory with the buffer: zero copy
    assert all(np.shares_memory(v, buffer) for v in views.values())


def test_unflatten_of_read_only_buffer_gives_read_only_views():
    buffer, index = flat.flatten({"x": np.arange(8, dtype=np.float32)})
    buffer.setflags(write=False)
    view = flat.unflatten(buffer, index)["x"]
    assert not view.flags.writeable and np.array_equal(view, np.arange(8))


def test_manifest_chunks_cover_buffer_and_checksums_match_zlib():
    buffer = np.random.default_rng(0).integers(0, 256, 1000, dtype=np.uint8)
    index, _ = flat.layout([("w", "uint8", (1000,))])
    m = flat.make_manifest(7, buffer, index, 3)
    assert m.version == 7 and m.num_chunks == 3 and m.total_bytes == 1000
    assert m.chunks == chunk_bounds(1000, 3)
    assert m.checksums == tuple(zlib.crc32(buffer[s:e].tobytes()) for s, e in m.chunks)
    for i, (s, e) in enumerate(m.chunks):
        assert flat.check_chunk(m, i, buffer[s:e]) is None


@settings(max_examples=50, deadline=None)
@given(size=st.integers(1, 4000), k=st.integers(1, 16), pos=st.integers(0, 10**6),
       bit=st.integers(0, 7), data=st.data())
def test_any_single_bit_flip_or_truncation_is_rejected(size, k, pos, bit, data):
    k = min(k, size)
    buffer = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    m = flat.make_manifest(1, buffer, (), k)
    i = data.draw(st.integers(0, k - 1))
    s, e = m.chunks[i]
    chunk = buffer[s:e].copy()
    chunk[pos % chunk.size] ^= np.uint8(1 << bit)
    assert "crc32" in flat.check_chunk(m, i, chunk)
    assert "truncated" in flat.check_chunk(m, i, buffer[s:e - 1])
    assert "truncated" in flat.check_chunk(m, i, np.concatenate([buffer[s:e], buffer[:1]]))


def test_check_chunk_rejects_wrong_type_and_index():
    buffer = np.zeros(16, np.uint8)
    m = flat.make_manifest(0, buffer, (), 2)
    assert "out of range" in flat.check_chunk(m, 2, buffer[:8])
    assert "uint8" in flat.check_chunk(m, 0, buffer[:8].view(np.int8))


def test_errors_name_the_problem():
    cfg = DecoderConfig.preset("tiny")
    params = _random_params(cfg)
    del params["final_norm"]
    with pytest.raises(KeyError, match="final_norm"):
        flat.params_to_flat(cfg, params)
    params = _random_params(cfg)
    params["layers"]["q_kernel"] = params["layers"]["q_kernel"][:, :, :2]
    with pytest.raises(ValueError, match="q_proj.weight"):
        flat.params_to_flat(cfg, params)
    with pytest.raises(ValueError, match="appears twice"):
        flat.layout([("a", "float32", (1,)), ("a", "float32", (1,))])
    with pytest.raises(ValueError, match="outside the buffer"):
        flat.unflatten(np.zeros(4, np.uint8), (flat.TensorEntry("w", "float32", (2,), 0),))
    with pytest.raises(ValueError, match="1-D uint8"):
        flat.unflatten(np.zeros(4, np.float32), ())
