"""Nothing listens beyond loopback: a real `laminar train` (embedded Ray, relays, rollouts), in a
subprocess whose environment has none of the test session's Ray settings, is audited with psutil
every half second -- every listening socket of every process of the run (driver, GCS, raylets,
agents, workers, relay streams) must be on 127.0.0.1 / ::1.

The same run has too few prompts for run.steps (data.max_epochs=1), so it also shows the
liveness stop end to end: a named error seconds after the prompts ran out, not the learner's
900 s stall. Its event log must not carry the relay group's stream token.
"""
import ipaddress
import json
import os
import subprocess
import sys
import time

import psutil
import pytest

from tests.laminar_jax.runtime.runtime_fixtures import cli_env

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _listening(root: psutil.Process) -> dict[tuple, str]:
    """{(ip, port): process name} of every LISTEN socket in `root`'s process tree."""
    try:
        procs = {p.pid: p for p in [root, *root.children(recursive=True)]}
    except psutil.NoSuchProcess:
        return {}
    out = {}
    for c in psutil.net_connections(kind="inet"):
        if c.status == psutil.CONN_LISTEN and c.pid in procs:
            try:
                name = procs[c.pid].name()
            except psutil.NoSuchProcess:
                name = "?"
            out[(c.laddr.ip, c.laddr.port)] = name
    return out


def _loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(addr, "ipv4_mapped", None)
    return (mapped or addr).is_loopback


def test_a_run_listens_on_loopback_only_and_stops_when_prompts_run_out(warm_model, tmp_path):
    env = cli_env(ROOT)
    args = [f"run.out_dir={tmp_path}", "run.name=audit", f"model.hf_path={warm_model}", "data.task=arithmetic",
            "data.group_size=4", "data.num_prompts=8", "data.max_epochs=1", "data.task_max_n=9",
            "learner.global_batch_groups=4", "learner.max_seq_len=32", "rollout.max_new_tokens=8",
            "rollout.num_rollouts=2", "rollout.max_concurrency=16", "rollout.kv_budget_tokens=512",
            "run.steps=10", "reward.fn=task", "manager.repack_interval_s=0.5"]
    out, err = open(tmp_path / "stdout", "w+"), open(tmp_path / "stderr", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "laminar_jax.cli", "train", "configs/default.yaml", *args],
                            cwd=ROOT, env=env, stdout=out, stderr=err)
    # every (ip, port) ever seen listening, with every name its process had: a port's process
    # is renamed (ray::IDLE -> ray::RolloutWorker) and its port may be reused late in the run
    seen: dict[tuple, set[str]] = {}
    try:
        root = psutil.Process(proc.pid)
        deadline = time.time() + 400
        while proc.poll() is None and time.time() < deadline:
            for addr, name in _listening(root).items():
                seen.setdefault(addr, set()).add(name)
            time.sleep(0.25)
        assert proc.poll() is not None, "the run neither finished nor stopped"
    finally:
        if proc.poll() is None:
            proc.kill()
    out.seek(0), err.seek(0)
    stdout, stderr = out.read(), err.read()
    names = set().union(*seen.values())
    assert {"gcs_server", "raylet"} <= names, names
    assert any("RelayWorker" in n for n in names), names     # the relay stream servers
    assert any("RolloutWorker" in n for n in names), names
    exposed = {k: v for k, v in seen.items() if not _loopback(k[0])}
    assert not exposed, exposed
    # the liveness stop, with the key to change, after two steps' worth of prompts
    assert proc.returncode != 0
    assert "laminar train stopped: prompts exhausted: data.max_epochs=1 passes over 8 prompts" in stderr, stderr[-3000:]
    assert "step    1/9" in stdout, stdout[-2000:]   # steps 0 and 1 ran (0-based, as the metrics)
    assert "Traceback" not in stderr and "error: laminar train stopped: prompts exhausted" in stderr
    events = [json.loads(line) for line in open(tmp_path / "audit" / "events.jsonl")]
    assert not any("token" in k for e in events for k in e), "an event carries a token field"
