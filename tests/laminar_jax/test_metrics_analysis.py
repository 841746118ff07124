"""Run folder: RunWriter -> load_run round trip, crash safety, resume, TensorBoard scalars."""
from __future__ import annotations

import json
import math
import pathlib
import struct
import subprocess
import sys
import time

import numpy as np
import pandas as pd
import pytest

from laminar_jax.analysis import find_runs, load_events, load_metrics, load_run
from laminar_jax.config import Config, config_from_dict, dump_config, load_config
from laminar_jax.metrics import RunWriter, _import_tensorboardx

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_round_trip_values_nan_fill_and_events(tmp_path):
    cfg = load_config(None, ["run.name=rt", "optimizer.lr=2e-5"])
    with RunWriter(tmp_path / "run", cfg, flush_every=100, tensorboard=False) as writer:
        writer.log_step(0, {"loss": np.float32(1.5), "lr": 2e-5, "mode": "laminar"})
        writer.log_step(1, {"loss": np.array(0.75), "lr": 2e-5, "kl": np.float64(0.125),
                            "groups": np.int64(4)})
        writer.log_step(2, {"loss": 0.5, "lr": 1e-5, "kl": 0.0625, "done": True})
        writer.log_trajectories([
            {"id": "t0", "length": 5, "reward": 1.0, "gen_version": 0, "tokens": np.arange(3)},
            {"id": "t1", "length": 9, "reward": 0.0, "gen_version": 1, "tokens": [7]},
        ])
        writer.log_event("publish", version=1, bytes=np.int64(1 << 40), path=tmp_path / "w")
        writer.log_event("repack", moves=[{"source": "r0", "destination": "r1"}])

    run = load_run(tmp_path / "run")
    assert run.name == "run"
    assert run.config == dump_config(cfg)
    assert config_from_dict(run.config) == cfg

    m = run.metrics
    assert list(m["step"]) == [0, 1, 2]
    assert list(m["loss"]) == [1.5, 0.75, 0.5]
    assert list(m["lr"]) == [2e-5, 2e-5, 1e-5]
    assert math.isnan(m["kl"][0]) and list(m["kl"][1:]) == [0.125, 0.0625]  # appeared at step 1
    assert math.isnan(m["groups"][0]) and m["groups"][1] == 4 and math.isnan(m["groups"][2])
    assert m["mode"][0] == "laminar" and m["mode"][1:].isna().all()

    t = run.trajectories
    assert list(t["id"]) == ["t0", "t1"] and list(t["length"]) == [5, 9]
    assert [list(x) for x in t["tokens"]] == [[0, 1, 2], [7]]

    e = run.events
    assert list(e["kind"]) == ["publish", "repack"]
    assert e["version"][0] == 1 and e["bytes"][0] == 1 << 40 and e["path"][0] == str(tmp_path / "w")
    assert e["moves"][1] == [{"source": "r0", "destination": "r1"}]
    assert math.isnan(e["version"][1])
    assert e["time"].is_monotonic_increasing and abs(e["time"][0] - pd.Timestamp.now().timestamp()) < 3600


def test_rows_survive_a_crash_up_to_the_last_flush(tmp_path):
    writer = RunWriter(tmp_path, flush_every=2, tensorboard=False)
    for step in range(5):
        writer.log_step(step, {"loss": float(step)})
    writer.log_event("failure", rollout="r3")
    # No close(): the process "dies" here. Steps 0-3 were flushed, the event line is on disk.
    run = load_run(tmp_path)
    assert list(run.metrics["step"]) == [0, 1, 2, 3]
    assert list(run.events["kind"]) == ["failure"] and run.events["rollout"][0] == "r3"
    assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())
    writer.close()
    assert list(load_run(tmp_path).metrics["step"]) == [0, 1, 2, 3, 4]


def test_resume_keeps_rows_and_rewinds_to_the_checkpoint(tmp_path):
    with RunWriter(tmp_path, tensorboard=False) as writer:
        for step in range(6):
            writer.log_step(step, {"loss": float(step)})
        writer.log_event("checkpoint", step=3)
    # Resumed from the step-3 checkpoint: steps 4 and 5 are redone with new values.
    with RunWriter(tmp_path, tensorboard=False) as writer:
        assert writer.num_steps == 6
        writer.log_step(4, {"loss": 40.0, "new_metric": 1.0})
        writer.log_event("resume", step=4)
    run = load_run(tmp_path)
    assert list(run.metrics["step"]) == [0, 1, 2, 3, 4]
    assert list(run.metrics["loss"]) == [0.0, 1.0, 2.0, 3.0, 40.0]
    assert run.metrics["new_metric"][:4].isna().all() and run.metrics["new_metric"][4] == 1.0
    assert list(run.events["kind"]) == ["checkpoint", "resume"]


def test_bad_values_are_rejected_with_their_name(tmp_path):
    with RunWriter(tmp_path, tensorboard=False) as writer:
        with pytest.raises(ValueError, match=r"metric 'hist': expected a scalar number.*\(3,\)"):
            writer.log_step(0, {"hist": np.zeros(3)})
        with pytest.raises(ValueError, match="'step' is the row key"):
            writer.log_step(0, {"step": 1})
        with pytest.raises(ValueError, match="'time' is set by the writer"):
            writer.log_event("publish", time=0.0)
        writer.log_step(0, {"x": 1.0})
        with pytest.raises(ValueError, match=r"metric 'x': got a str \('text'\) in a column "
                                             "of number values"):
            writer.log_step(1, {"x": "text"})
        with pytest.raises(ValueError, match=r"trajectory field 'id': got a number \(3\) in a "
                                             "column of str values"):
            writer.log_trajectories([{"id": "t0", "new": 1}, {"id": 3}])
        writer.log_trajectories([{"id": "t1", "new": "ok"}])  # the rejected batch left no trace
        writer.log_step(1, {"x": 2})
    assert list(load_run(tmp_path).metrics["x"]) == [1.0, 2.0]
    with pytest.raises(RuntimeError, match="closed"):
        writer.log_step(2, {})


def _read_tb_scalars(tb_dir: pathlib.Path) -> dict[str, list[tuple[int, float]]]:
    _import_tensorboardx()
    from tensorboardX.proto import event_pb2

    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(tb_dir.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        offset = 0
        while offset < len(data):  # TFRecord framing: u64 length, u32 crc, payload, u32 crc
            (length,) = struct.unpack("<Q", data[offset:offset + 8])
            event = event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
            offset += 12 + length + 4
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def test_tensorboard_scalars(tmp_path):
    with RunWriter(tmp_path, flush_every=1) as writer:
        writer.log_step(0, {"loss": 2.0, "mode": "sync"})
        writer.log_step(1, {"loss": 1.0, "reward": np.float32(0.5)})
    scalars = _read_tb_scalars(tmp_path / "tb")
    assert scalars == {"loss": [(0, 2.0), (1, 1.0)], "reward": [(1, 0.5)]}


def test_writer_and_analysis_import_neither_jax_nor_torch(tmp_path):
    code = (
        "import sys\n"
        "from laminar_jax.metrics import RunWriter\n"
        "from laminar_jax.analysis import load_run\n"
        f"w = RunWriter({str(tmp_path)!r}); w.log_step(0, {{'a': 1.0}}); w.close()\n"
        "load_run(w.run_dir)\n"
        "print(sorted(m for m in ('jax', 'torch', 'ray') if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_load_run_errors_and_optional_files(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"{tmp_path / 'nope'}: no such run folder"):
        load_run(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="not a run folder"):
        load_run(tmp_path / "empty")
    only_events = tmp_path / "only_events"
    only_events.mkdir()
    (only_events / "events.jsonl").write_text(json.dumps({"time": 1.0, "kind": "start"}) + "\n")
    run = load_run(only_events)
    assert run.config == {} and run.metrics.empty and list(run.metrics.columns) == ["step"]
    assert run.trajectories.empty and list(run.events["kind"]) == ["start"]


def test_events_tolerate_a_cut_last_line_only(tmp_path):
    path = tmp_path / "events.jsonl"
    good = json.dumps({"time": 1.0, "kind": "a", "x": 1})
    path.write_text(good + "\n" + '{"time": 2.0, "ki')
    assert list(load_events(path)["kind"]) == ["a"]
    path.write_text(good + "\nnot json\n" + good + "\n")
    with pytest.raises(ValueError, match=f"{path}:2: not a JSON event line"):
        load_events(path)


def test_find_runs_and_load_metrics(tmp_path):
    for name, losses in (("a", [1.0, 0.5]), ("b", [2.0])):
        with RunWriter(tmp_path / "sweep" / name, Config(), tensorboard=False) as writer:
            for step, loss in enumerate(losses):
                writer.log_step(step, {"loss": loss})
    (tmp_path / "sweep" / "not_a_run").mkdir()
    runs = find_runs(tmp_path)
    assert runs == [tmp_path / "sweep" / "a", tmp_path / "sweep" / "b"]
    frame = load_metrics(runs)
    assert list(frame.columns[:2]) == ["run", "step"]
    assert list(zip(frame["run"], frame["step"], frame["loss"])) == [
        ("a", 0, 1.0), ("a", 1, 0.5), ("b", 0, 2.0)]


def test_reward_gain_compares_within_strata():
    from laminar_jax.analysis import reward_gain
    # hard prompts (reward 0.2 -> 0.4) and easy ones (0.9 -> 1.0); the late part draws mostly
    # hard ones, so the raw means fall (0.725 -> 0.55) while every stratum rises
    rows = ([("hard", 0, 0.2)] * 2 + [("easy", 0, 0.9)] * 6 + [("mid", 5, 0.5)] * 3
            + [("hard", 9, 0.4)] * 6 + [("easy", 9, 1.0)] * 2 + [("only_late", 9, 0.0)] * 4)
    t = pd.DataFrame(rows, columns=["n", "gen_version", "reward"])
    g = reward_gain(t, strata="n")
    early, late = t[t.gen_version <= 3].reward.mean(), t[t.gen_version >= 6].reward.mean()
    assert late < early
    # weights min(count): hard 2, easy 2 -> early (0.2 + 0.9) / 2, late (0.4 + 1.0) / 2
    assert g["early"] == pytest.approx(0.55) and g["late"] == pytest.approx(0.7)
    assert g["gain"] == pytest.approx(0.15) and g["strata"] == 2
    assert (g["early_count"], g["late_count"]) == (8, 12)
    with pytest.raises(KeyError, match="no column 'prompt_len'"):
        reward_gain(t)
    with pytest.raises(ValueError, match="fraction"):
        reward_gain(t, strata="n", fraction=0.7)
    assert math.isnan(reward_gain(t[t.gen_version == 0], strata="n")["gain"])


def _old_single_file_table(rows: list[dict]) -> pd.DataFrame:
    """What the single-file writer wrote: one DataFrame from every row, through Parquet."""
    import io
    buf = io.BytesIO()
    pd.DataFrame.from_records(rows).to_parquet(buf, index=False)
    return pd.read_parquet(io.BytesIO(buf.getvalue()))


def test_part_files_read_as_the_old_single_file_table(tmp_path):
    steps, trajectories = [], []
    with RunWriter(tmp_path, flush_every=2, tensorboard=False) as writer:
        for step in range(7):
            m = {"loss": 1.0 / (step + 1), "lr": 1e-3}
            if step >= 3:
                m["kl"] = 0.1 * step              # a column that appears mid-run
            if step in (1, 5):
                m["note"] = f"s{step}"            # strings in some parts only
            if step < 2:
                m["done"] = step == 1             # a bool column that disappears
            writer.log_step(step, m)
            steps.append({"step": step, **m})
            rows = [{"trajectory_id": f"e0-{step}/{i}", "reward": float(i), "tokens": list(range(i + 1))}
                    | ({"t_repack": 0.5} if step == 4 else {}) for i in range(3)]
            writer.log_trajectories(rows, step=step)
            trajectories += [dict(r, step=step) for r in rows]
    assert len(list((tmp_path / "metrics").glob("part-*.parquet"))) == 4
    run = load_run(tmp_path)
    pd.testing.assert_frame_equal(run.metrics, _old_single_file_table(steps))
    pd.testing.assert_frame_equal(run.trajectories, _old_single_file_table(trajectories))
    # an older run folder (one metrics.parquet, no parts) still loads
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    _old_single_file_table(steps).to_parquet(legacy / "metrics.parquet", index=False)
    pd.testing.assert_frame_equal(load_run(legacy).metrics, run.metrics)


def test_rewind_drops_metrics_and_trajectories_of_redone_steps(tmp_path):
    with RunWriter(tmp_path, flush_every=4, tensorboard=False) as writer:
        for step in range(10):  # parts: steps 0-3, 4-7, 8-9
            writer.log_step(step, {"loss": float(step)})
            writer.log_trajectories([{"trajectory_id": f"t{step}-{i}"} for i in range(2)], step=step)
    with RunWriter(tmp_path, tensorboard=False) as writer:  # resumed from the checkpoint after step 5
        assert writer.num_steps == 10 and writer.last_step == 9
        writer.rewind(6)
        assert writer.num_steps == 6
        for step in range(6, 8):
            writer.log_step(step, {"loss": 10.0 * step})
            writer.log_trajectories([{"trajectory_id": f"t{step}-{i}"} for i in range(2)], step=step)
    run = load_run(tmp_path)
    assert list(run.metrics.step) == list(range(8))
    assert list(run.metrics.loss) == [0, 1, 2, 3, 4, 5, 60, 70]
    assert run.trajectories.trajectory_id.is_unique and len(run.trajectories) == 16
    assert list(run.trajectories.step) == sorted(run.trajectories.step)


def test_writer_memory_stays_flat_over_100k_trajectories(tmp_path):
    code = (
        "import psutil\n"
        "from laminar_jax.metrics import RunWriter\n"
        f"w = RunWriter({str(tmp_path)!r}, tensorboard=False)\n"
        "rss = []\n"
        "for step in range(100):\n"
        "    w.log_step(step, {'loss': 1.0})\n"
        "    w.log_trajectories(({'group_id': f'e0-{step}-{i // 8}', 'prompt_id': f'p{i}', 'sample_index': i % 8,\n"
        "                         'rollout_id': 'rollout-0', 'prompt_len': 10, 'response_len': 20, 'reward': 0.5,\n"
        "                         'finish_reason': 'stop', 'gen_version': step, 'staleness': 1, 't_gen': 0.2}\n"
        "                        for i in range(1000)), step=step)\n"
        "    if step % 10 == 9:\n"
        "        rss.append(psutil.Process().memory_info().rss / 2**20)\n"
        "w.close()\n"
        "print(*rss)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    rss = [float(x) for x in proc.stdout.split()]
    # after the first flushes, 80k more rows (~100 MB as python dicts) add no memory
    assert max(rss[2:]) - rss[1] < 15, rss
    import pyarrow.parquet as pq
    assert sum(pq.ParquetFile(p).metadata.num_rows for p in (tmp_path / "trajectories").iterdir()) == 100_000


def test_trackers_come_from_the_config(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config(None, ["run.trackers=[wandb]"])
    with RunWriter(tmp_path / "wb", cfg) as writer:
        assert writer.trackers == ("wandb",)
        writer.log_step(0, {"loss": 2.0})
        writer.log_step(1, {"loss": 1.0, "reward_seen_by_wandb": 0.5})
    assert not (tmp_path / "wb" / "tb").exists()
    (log,) = (tmp_path / "wb" / "wandb").glob("offline-run-*/run-*.wandb")
    deadline = time.time() + 60  # the W&B service process finishes writing after finish() returns
    while b"reward_seen_by_wandb" not in log.read_bytes() and time.time() < deadline:
        time.sleep(0.2)
    assert b"reward_seen_by_wandb" in log.read_bytes()
    with RunWriter(tmp_path / "none", load_config(None, ["run.trackers=[]"])) as writer:
        assert writer.trackers == ()
        writer.log_step(0, {"loss": 1.0})
    assert sorted(p.name for p in (tmp_path / "none").iterdir()) == ["config.yaml", "events.jsonl", "metrics"]


def test_reward_gain_defaults_and_exact_rate():
    from laminar_jax.analysis import reward_gain
    from laminar_jax.metrics import exact_rate
    # a run shorter than an epoch: every prompt drawn once, so prompt ids never pair up; prompt
    # lengths do (the default strata)
    rows = [(f"p{i}", 3 + i % 2, v, 0.2 + 0.1 * (i % 2) + 0.05 * v) for v in range(7) for i in range(4 * v, 4 * v + 4)]
    t = pd.DataFrame(rows, columns=["prompt_id", "prompt_len", "gen_version", "reward"])
    g = reward_gain(t)
    assert g["strata"] == 2 and g["gain"] == pytest.approx(0.05 * (5 - 1))  # early v 0-2, late v 4-6
    assert math.isnan(reward_gain(t, strata="prompt_id")["gain"])
    assert exact_rate([1.0, 0.5, 1.0, 0.0]) == 0.5 and math.isnan(exact_rate([]))
