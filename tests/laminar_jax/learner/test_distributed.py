"""The multi-host learner step (learner/distributed.py) for real: two processes x 4 fake CPU devices
joined by jax.distributed (gloo collectives) run the learner's own jitted RL train step
(runtime/rl_step.py) on one global (data, fsdp, tensor) = (2, 2, 2) mesh. Each gets only its
groups of every global batch (the data actor's `host_parts`) and builds only its rows
(runtime/host_batch.py: agreed length, whole-batch advantages, normaliser summed over hosts);
the loss, grad norm and final params equal one process with 8 devices running the same steps on
the whole batch (fp tolerance: only the reduction order differs).

This file is also the worker: `python test_distributed.py <processes> <id> <coordinator> <out>`."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROWS, LEN, PROMPT, STEPS = 8, 16, 4, 3
GROUPS, GROUP_SIZE = 2, 4
# optimizer.eps=1e-3: Adam moves a near-zero-gradient weight by about lr whatever the gradient's
# size, which would turn reduction-order noise into lr-sized differences; a large eps keeps the
# update linear in the gradient, so the two runs' params compare at fp tolerance
OVERRIDES = [f"learner.global_batch_groups={GROUPS}", f"data.group_size={GROUP_SIZE}", "learner.micro_batch_size=4",
             "mesh.data=-1", "mesh.fsdp=2", "mesh.tensor=2", "optimizer.lr=0.05", "optimizer.eps=1e-3", f"run.steps={STEPS}",
             "learner.precompile=false"]


def global_groups(vocab: int, step: int) -> list:
    """The step's whole batch as the data actor samples it: GROUPS groups of GROUP_SIZE
    trajectories (seeded by the step), the same on every host before the split."""
    from laminar_jax.data.records import Trajectory
    rng = np.random.default_rng(step)
    groups = []
    for g in range(GROUPS):
        group = []
        for i in range(GROUP_SIZE):
            n = int(rng.integers(3, LEN - PROMPT + 1))
            logp = (-rng.uniform(0.5, 5.0, n)).astype(np.float32)
            group.append(Trajectory(group_id=f"e0-{g}", prompt_id=f"p{g}", sample_index=i, rollout_id="r0",
                                    prompt_tokens=rng.integers(0, vocab, PROMPT), response_tokens=rng.integers(0, vocab, n),
                                    behaviour_logp=logp, sample_logp=logp, token_versions=np.zeros(n, np.int64),
                                    gen_version=0, reward=float(rng.normal()), finish_reason="stop"))
        groups.append(group)
    return groups


def host_inputs(cfg, fns, groups) -> dict:
    """This host's train inputs from its own groups, as the learner builds them
    (runtime/learner_actor.py `_update`): agreed length, whole-batch advantages, its rows only,
    the normaliser summed over the hosts."""
    from laminar_jax.runtime import batch as B
    from laminar_jax.runtime import host_batch, rl_step
    plan = host_batch.plan(groups, max_seq_len=LEN, min_len=LEN)
    batch = B.assemble(groups, learner_version=0, max_seq_len=LEN, min_len=LEN, rows=len(groups) * GROUP_SIZE,
                       length=plan.length)
    batch["advantages"], _ = host_batch.advantages(fns.advantages, batch, plan)
    mb, = host_batch.layout(batch, 1, pack_rows=False, max_seq_len=LEN, row_multiple=fns.row_multiple)
    return rl_step.train_inputs(cfg, mb)


def _flat(tree) -> dict:
    import jax
    from jax.experimental import multihost_utils
    full = multihost_utils.process_allgather(tree, tiled=True)   # the global values, on every host
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(full)[0]}


def _wait_for(path: str, timeout_s: float = 400.0) -> None:
    import time
    t0 = time.time()
    while not os.path.isdir(path):
        if time.time() - t0 > timeout_s:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.2)


def worker(processes: int, process_id: int, coordinator: str, out: str) -> None:
    from laminar_jax.learner import distributed as dist
    dist.initialize(coordinator, num_processes=processes, process_id=process_id, timeout_s=60)
    import jax

    from laminar_jax.config import load_config
    from laminar_jax.learner.setup import build
    from laminar_jax.runtime import rl_step

    cfg = load_config(None, OVERRIDES)
    setup = build(cfg, total_steps=STEPS)
    fns = rl_step.build(cfg, setup, mini_batch_rows=ROWS)
    state, losses, norms = setup.state, [], []
    from laminar_jax.runtime.data_actor import host_parts
    for step in range(STEPS):
        # the data actor's split: this host gets only its groups, and builds only its rows
        mine = host_parts(global_groups(cfg.model.vocab_size, step), processes)[process_id]
        state, m = fns.train(state, dist.global_arrays(host_inputs(cfg, fns, mine), setup.mesh))
        print(f"host {process_id}: step {step} loss {m['loss']:.6f}", flush=True)
        losses.append(m["loss"])
        norms.append(m["grad_norm"])
    flat = _flat(state.params)
    # checkpoints across host counts: save here (each process writes its shards), then restore
    # the other run's checkpoint (saved by 1 process if this is 2, by 2 if this is 1) onto this mesh
    from laminar_jax.runtime.checkpoint import Checkpointer
    here = os.path.join(os.path.dirname(out), f"run{processes}")
    other = os.path.join(os.path.dirname(out), f"run{3 - processes}")
    ckpt = Checkpointer(here)
    ckpt.save(STEPS, state, {"version": STEPS, "data": {}})
    ckpt.close()
    _wait_for(os.path.join(other, "checkpoints", str(STEPS)))
    restored, meta = Checkpointer(other).restore(STEPS, state)
    # publish: the 2-host run publishes the 1-host run's params (restored exactly), each host
    # writing its own shards; the 1-host run publishes its own: the store bytes must be equal
    from laminar_jax.weights.publish import Publisher, WeightStore
    pub = Publisher(WeightStore.local(os.path.join(os.path.dirname(out), f"store{processes}")), dtype="bfloat16")
    pub.publish(1, restored.params if processes == 2 else state.params)
    pub.close()
    same_layout = all(a.sharding == b.sharding for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)))
    trees = {"params": flat, "restored": _flat(restored.params), "opt": _flat(state.opt_state),
             "restored_opt": _flat(restored.opt_state)}
    if process_id == 0:   # arrays as .npz (JSON lists of a million floats take long to write)
        np.savez(out + ".npz", **{f"{t}|{k}": v for t, tree in trees.items() for k, v in tree.items()})
        with open(out, "w") as f:
            json.dump({"losses": losses, "grad_norms": norms,
                       "restored_step": int(np.asarray(restored.step.addressable_data(0))),
                       "meta_version": meta["version"], "same_layout": same_layout,
                       "devices": jax.device_count(), "local_devices": jax.local_device_count(),
                       "mesh": dict(setup.mesh.shape), "processes": jax.process_count()}, f)


# The workers' time is XLA compiles (3 steps of a tiny model): LLVM at -O0 halves them (measured
# on the tiny decoder, experiments-free: /work notes); the equalities checked here are between
# programs compiled alike, so the level does not enter them.
FAST_COMPILE = "--xla_backend_optimization_level=0"


def _spawn(processes: int, process_id: int, devices: int, coordinator: str, out: str) -> subprocess.Popen:
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}",
               JAX_PLATFORMS="cpu", PYTHONPATH=os.getcwd())
    return subprocess.Popen([sys.executable, __file__, str(processes), str(process_id), coordinator, out],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait(procs, timeout=900):
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, o in zip(procs, outs):
        assert p.returncode == 0, o[-3000:]


def test_two_processes_equal_one_process_with_all_devices(tmp_path):
    from laminar_jax.learner.distributed import coordinator_address
    coord = coordinator_address()
    two, one = str(tmp_path / "two.json"), str(tmp_path / "one.json")  # run2/, run1/: checkpoints
    procs = [_spawn(2, 0, 4, coord, two), _spawn(2, 1, 4, coord, two), _spawn(1, 0, 8, "-", one)]
    _wait(procs)
    a, b = json.load(open(two)), json.load(open(one))
    for x, path in ((a, two), (b, one)):
        with np.load(path + ".npz") as z:
            for t in ("params", "restored", "opt", "restored_opt"):
                x[t] = {k.split("|", 1)[1]: z[k] for k in z.files if k.startswith(t + "|")}
    from laminar_jax.weights.publish import WeightStore, read_version
    import jax
    w2, w1 = ({jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(
        read_version(WeightStore(str(tmp_path / f"store{n}")), 1))[0]} for n in (2, 1))
    assert w2.keys() == w1.keys() and len(w1) > 0
    for k in w1:   # a 2-host publish holds the same bytes as a 1-host publish of the same params
        assert w2[k].dtype == w1[k].dtype and w2[k].tobytes() == w1[k].tobytes(), k
    # ... written per host (each its own shards and a checksummed manifest, no gather), and the
    # master's engine layout of it is the 1-host one's
    from laminar_jax.config import load_config
    from laminar_jax.runtime.engines import model_config
    from laminar_jax.weights import host_shards, master
    stores = [WeightStore(str(tmp_path / f"store{n}")) for n in (2, 1)]
    assert host_shards.is_host_sharded(stores[0].path(1)) and not host_shards.is_host_sharded(stores[1].path(1))
    assert not host_shards.missing_hosts(stores[0].path(1), 2)
    mcfg = model_config(load_config(None, OVERRIDES), None)
    (m2, b2, _), (m1, b1, _) = (master.prepare(master.MasterRole(store=st, cfg=mcfg, chain_length=2), 1, st.path(1))
                                for st in stores)
    assert m2 == m1 and np.array_equal(b2, b1)
    assert (a["processes"], a["devices"], a["local_devices"]) == (2, 8, 4)
    assert (b["processes"], b["devices"]) == (1, 8)
    assert a["mesh"] == b["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2}
    np.testing.assert_allclose(a["losses"], b["losses"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(a["grad_norms"], b["grad_norms"], rtol=1e-5, atol=1e-6)
    assert len(set(np.round(a["losses"], 6))) == STEPS   # the steps did change the params
    assert a["params"].keys() == b["params"].keys()
    for k in a["params"]:
        np.testing.assert_allclose(a["params"][k], b["params"][k], rtol=1e-4, atol=1e-5, err_msg=k)
    # 2 -> 1 and 1 -> 2: each run restored the other's checkpoint exactly, onto its own layout
    for x, y in ((a, b), (b, a)):
        for t, u in (("restored", "params"), ("restored_opt", "opt")):
            assert x[t].keys() == y[u].keys() and all(np.array_equal(x[t][k], y[u][k]) for k in y[u])
        assert (x["restored_step"], x["meta_version"], x["same_layout"]) == (STEPS, STEPS, True)


@pytest.mark.parametrize("mesh,hosts,local,msg", [
    (dict(data=-1, fsdp=2, tensor=8), 2, 4, "mesh.tensor must divide"),
    (dict(data=2, fsdp=2, tensor=1), 2, 4, "must use every device"),
    (dict(data=-1, fsdp=3, tensor=1), 2, 4, "does not divide the 8 devices"),
])
def test_a_mesh_that_does_not_divide_across_hosts_names_mesh_and_hosts(mesh, hosts, local, msg):
    from types import SimpleNamespace

    from laminar_jax.learner.distributed import check_mesh
    with pytest.raises(ValueError, match=msg) as e:
        check_mesh(SimpleNamespace(**mesh), hosts=hosts, local_devices=local)
    assert "mesh.data=" in str(e.value) and f"learner.hosts={hosts}" in str(e.value)
    check_mesh(SimpleNamespace(data=-1, fsdp=2, tensor=2), hosts=2, local_devices=4)   # divides


def test_host_slices_cover_the_batch_once():
    from laminar_jax.learner.distributed import host_slice, local_part
    batch = {"x": np.arange(12).reshape(6, 2), "n": np.float32(3.0)}
    parts = [local_part(batch, hosts=3, process=p) for p in range(3)]
    np.testing.assert_array_equal(np.concatenate([p["x"] for p in parts]), batch["x"])
    assert all(p["n"] == 3.0 for p in parts)
    with pytest.raises(ValueError, match="does not split across 4 learner hosts"):
        host_slice(6, hosts=4, process=0)


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
