"""weights/host_shards.py: a multi-host learner's per-host shards and manifests, assembled by the
master. The hosts' pieces here are cut from host numpy params the way a (data, fsdp) mesh over
two hosts cuts them (row halves, column halves, a replicated tensor written by host 0 only); the
real two-process publish is in tests/laminar_jax/learner/test_distributed.py."""
import os

import numpy as np
import pytest

from laminar_jax.models import hf
from laminar_jax.models.config import DecoderConfig
from laminar_jax.weights import flat, host_shards, master, publish

CFG = DecoderConfig.preset("tiny")


def split_pieces(tree: dict, hosts: int, prefix: tuple = ()) -> list[list[host_shards.Piece]]:
    """Per host, its pieces of a nested dict of numpy arrays: rank >= 2 tensors alternately split
    by rows and by columns, rank 1 by rows, scalars replicated (host 0 writes them)."""
    out: list[list[host_shards.Piece]] = [[] for _ in range(hosts)]
    for i, (k, v) in enumerate(sorted(tree.items())):
        if isinstance(v, dict):
            for h, part in enumerate(split_pieces(v, hosts, prefix + (k,))):
                out[h] += part
            continue
        v = np.asarray(v)
        name, axis = prefix + (k,), (i % 2 if v.ndim >= 2 else 0)
        if v.ndim == 0 or v.shape[axis] % hosts:
            out[0].append(host_shards.Piece(name, v.shape, v.dtype.name, tuple((0, n) for n in v.shape), v))
            continue
        step = v.shape[axis] // hosts
        for h in range(hosts):
            index = [(0, n) for n in v.shape]
            index[axis] = (h * step, (h + 1) * step)
            out[h].append(host_shards.Piece(name, v.shape, v.dtype.name, tuple(index),
                                            v[tuple(slice(a, b) for a, b in index)]))
    return out


def write_version(root: str, version: int, tree: dict, hosts: int = 2) -> str:
    """A finalized per-host version folder of `tree` (as host 0 leaves it)."""
    path = os.path.join(root, f"v{version:010d}")
    for h, pieces in enumerate(split_pieces(tree, hosts)):
        assert host_shards.write_host(path, version=version, host=h, hosts=hosts, pieces=pieces)
    return path


@pytest.fixture(scope="module")
def params():
    rng = np.random.default_rng(0)
    tensors = {e.hf_name: rng.standard_normal(e.hf_shape).astype(np.float32) for e in hf.name_map(CFG)}
    return tensors, hf.hf_to_params(CFG, tensors)


def _leaves(tree, prefix=()):
    for k, v in tree.items():
        yield from (_leaves(v, prefix + (k,)) if isinstance(v, dict) else [(prefix + (k,), np.asarray(v))])


def test_two_hosts_pieces_give_the_engine_layout_of_a_one_host_orbax_publish(tmp_path, params):
    tensors, tree = params
    store = publish.WeightStore.local(str(tmp_path / "hosts"))
    write_version(store.root, 1, tree)
    assert store.versions() == [1] and host_shards.is_host_sharded(store.path(1))
    got = dict(_leaves(publish.read_version(store, 1)))
    want = dict(_leaves(tree))
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)
    one = publish.WeightStore.local(str(tmp_path / "one"))
    pub = publish.Publisher(one, dtype="float32")
    pub.publish(1, tree)
    pub.close()
    assert not host_shards.is_host_sharded(one.path(1))
    role = lambda s: master.MasterRole(store=s, cfg=CFG, chain_length=3, num_chunks=5)  # noqa: E731
    m2, b2, _ = master.prepare(role(store), 1, store.path(1))
    m1, b1, _ = master.prepare(role(one), 1, one.path(1))
    assert np.array_equal(b2, b1) and m2 == m1
    assert np.array_equal(b2, flat.flatten(tensors)[0])


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_torn_host_shard_is_an_error_naming_the_host_and_the_tensor(tmp_path, params, damage):
    import ml_dtypes
    tree = {k: {"w": np.asarray(v, ml_dtypes.bfloat16)} for k, v in params[0].items()}   # bf16 bytes too
    path = write_version(str(tmp_path), 2, tree)
    got = dict(_leaves(host_shards.assemble(path)))
    assert all(got[k].dtype == ml_dtypes.bfloat16 and np.array_equal(got[k], v) for k, v in _leaves(tree))
    data = host_shards.data_path(path, 1)
    blob = bytearray(open(data, "rb").read())
    if damage == "truncate":
        blob = blob[:-3]
    else:
        blob[len(blob) // 2] ^= 0x10
    open(data, "wb").write(bytes(blob))
    with pytest.raises(host_shards.ShardError, match="host 1's shard of") as e:
        host_shards.assemble(path)
    assert e.value.host == 1 and e.value.tensor and e.value.tensor in str(e.value)
    assert ("torn" if damage == "truncate" else "crc32") in str(e.value)


def test_a_missing_host_manifest_or_an_uncovered_tensor_is_not_complete(tmp_path, params):
    path = write_version(str(tmp_path), 3, params[1], hosts=3)
    os.remove(host_shards.manifest_path(path, 2))
    with pytest.raises(host_shards.ShardError, match="host 2's manifest .* missing") as e:
        host_shards.assemble(path)
    assert e.value.host == 2
    # a host that leaves out a piece: the tensor is not covered
    path = write_version(str(tmp_path / "b"), 4, params[1])
    pieces = split_pieces(params[1], 2)[1][1:]
    host_shards.write_host(path, version=4, host=1, hosts=2, pieces=pieces)
    with pytest.raises(host_shards.ShardError, match="cover"):
        host_shards.assemble(path)


def test_host_0_finalizes_only_when_every_host_wrote_and_names_the_one_that_did_not(tmp_path, params):
    """HostShardWriter as the Publisher drives it: host 0 alone of two never finalizes the
    folder; once host 1's files land, it renames it and the version reads back whole."""
    import orbax.checkpoint as ocp
    tree = params[1]
    store = publish.WeightStore.local(str(tmp_path))
    lonely = host_shards.HostShardWriter(host=0, hosts=2, hosts_wait_s=0.3)
    lonely.save(store.path(5), ocp.args.PyTreeSave(tree))
    with pytest.raises(host_shards.ShardError, match=r"learner hosts \[1\] wrote no manifest") as e:
        lonely.wait_until_finished()
    assert e.value.host == 1 and store.versions() == []
    store.delete(5, temporary=True)   # the publisher's clean-up takes the staging folder too
    assert os.listdir(store.root) == []

    writer = host_shards.HostShardWriter(host=0, hosts=2, hosts_wait_s=60)
    writer.save(store.path(6), ocp.args.PyTreeSave(tree))
    # host 0's pieces in one process are whole tensors; host 1 adds nothing of them but the
    # manifest, so the coverage check still holds
    host_shards.write_host(host_shards.staging_path(store.path(6)), version=6, host=1, hosts=2, pieces=[])
    writer.wait_until_finished()
    writer.close()
    assert store.versions() == [6] and "copy_s" in writer.timings
    got, want = dict(_leaves(publish.read_version(store, 6))), dict(_leaves(tree))
    assert all(np.array_equal(got[k], want[k]) for k in want)
