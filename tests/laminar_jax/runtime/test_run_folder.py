"""Run-folder safety without Ray: run.resume's decisions on real folders, the refusal before Ray
starts, the crash hint, stale weight stores, and checkpoints that count only once committed."""
import os
import pathlib
import signal
import subprocess
import sys
import textwrap

import pytest

from laminar_jax.config import ConfigError, load_config
from laminar_jax.metrics import RunWriter
from laminar_jax.runtime import run_folder
from laminar_jax.runtime.checkpoint import checkpoint_due

REPO = pathlib.Path(__file__).resolve().parents[3]


def _cfg(tmp_path, *overrides):
    return load_config(REPO / "configs/default.yaml", [f"run.out_dir={tmp_path}", "run.name=r", *overrides])


def _make_run(tmp_path, *overrides, checkpoint=None):
    cfg = _cfg(tmp_path, *overrides)
    RunWriter(tmp_path / "r", cfg, tensorboard=False).close()
    if checkpoint is not None:
        (tmp_path / "r" / "checkpoints" / str(checkpoint)).mkdir(parents=True)
        # an uncommitted orbax save (a crash mid-write) is no checkpoint
        (tmp_path / "r" / "checkpoints" / f"{checkpoint + 2}.orbax-checkpoint-tmp-123").mkdir()
    return cfg


def test_resume_modes_on_an_existing_folder(tmp_path):
    fresh = run_folder.plan(_cfg(tmp_path), str(tmp_path / "r"))
    assert not fresh.resume and fresh.checkpoint is None
    _make_run(tmp_path, checkpoint=4)
    run_dir = str(tmp_path / "r")
    # auto: same config (more steps, another log cadence are fine) resumes the committed v4
    same = run_folder.plan(_cfg(tmp_path, "run.steps=90", "run.log_every=5"), run_dir)
    assert same.resume and same.checkpoint == 4 and "v4" in same.note
    # auto: a different config is refused, naming the key, the values and what to do
    with pytest.raises(ConfigError, match=r"different config \(optimizer\.lr: 0\.0003 -> 0\.0001\); "
                                          r"choose another run\.name .*run\.resume=force"):
        run_folder.plan(_cfg(tmp_path, "optimizer.lr=1e-4"), run_dir)
    # never: any folder holding a run is refused
    with pytest.raises(ConfigError, match=r"run\.resume=never: run folder .* already holds a run "
                                          r"\(checkpoint v4\); .*run\.resume=auto"):
        run_folder.plan(_cfg(tmp_path, "run.resume=never"), run_dir)
    # force: resumes, and keeps the config the folder was made with
    forced = run_folder.plan(_cfg(tmp_path, "optimizer.lr=1e-4", "run.resume=force"), run_dir)
    assert forced.resume and forced.checkpoint == 4
    assert len(list((tmp_path / "r").glob("config.*.yaml"))) == 1
    # a finished run is not silently "resumed" into zero steps
    with pytest.raises(ConfigError, match=r"run\.steps=3: .*already reached step 4; raise run\.steps"):
        run_folder.plan(_cfg(tmp_path, "run.steps=3"), run_dir)


def test_the_runs_own_warm_up_model_is_no_config_change(tmp_path):
    """The driver stores the warm-up's model folder as model.hf_path; rerunning the command (hf_path
    null, a preset) is the same config."""
    warm = tmp_path / "r" / "sft" / "sft_model"
    _make_run(tmp_path, f"model.hf_path={warm}")
    assert run_folder.plan(_cfg(tmp_path), str(tmp_path / "r")).resume
    with pytest.raises(ConfigError, match="model.hf_path"):
        run_folder.plan(_cfg(tmp_path, f"model.hf_path={tmp_path / 'other'}"), str(tmp_path / "r"))


def test_laminar_train_refuses_a_different_config_before_ray_starts(tmp_path, monkeypatch, capsys):
    from laminar_jax import cli
    from laminar_jax.runtime import driver
    _make_run(tmp_path)
    started = []
    monkeypatch.setattr(driver.cluster, "start", lambda cfg: started.append("ray"))
    monkeypatch.setattr(driver, "warm_up", lambda cfg, run_dir: started.append("warm-up"))
    rc = cli.main(["train", str(REPO / "configs/default.yaml"), f"run.out_dir={tmp_path}", "run.name=r",
                   "optimizer.lr=1e-4"])
    assert rc == 2 and started == []
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: run.resume=auto: run folder") and "optimizer.lr" in line


def test_a_crash_prints_the_resume_command(tmp_path, monkeypatch, capsys):
    from laminar_jax import cli
    args = [f"run.out_dir={tmp_path}", "run.name=r", "run.resume=never"]
    cfg = _cfg(tmp_path, "run.resume=never")

    def crash(_cfg):
        RunWriter(tmp_path / "r", _cfg, tensorboard=False).close()
        (tmp_path / "r" / "checkpoints" / "6").mkdir(parents=True)
        raise RuntimeError("learner died")

    assert cli._with_resume_hint(crash, cfg, args) == 1
    err = capsys.readouterr().err
    assert "RuntimeError: learner died" in err and "keeps checkpoint v6; resume with:" in err
    command = err.strip().splitlines()[-1].split()
    assert command[:2] == ["laminar", "train"] and command[-1] == "run.resume=auto"
    assert run_folder.plan(_cfg(tmp_path, *command[2:]), str(tmp_path / "r")).checkpoint == 6


def test_stale_weight_stores_are_removed_live_ones_kept(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"run-{dead.pid}"
    (stale / "v0000000003").mkdir(parents=True)
    live = tmp_path / f"run-{os.getpid()}"
    (live / "v0000000001").mkdir(parents=True)
    foreign = tmp_path / f"photos-{dead.pid}"  # not a weight store: left alone
    (foreign / "cat.jpg").mkdir(parents=True)
    assert run_folder.clean_stale_stores(str(tmp_path)) == [str(stale)]
    assert not stale.exists() and live.exists() and foreign.exists()
    assert run_folder.clean_stale_stores(str(tmp_path / "missing")) == []


def test_checkpoint_due_by_steps_seconds_and_the_end():
    due = lambda v, **kw: checkpoint_due(v, **{"last_version": 0, "last_time": 0.0, "now": 10.0,  # noqa: E731
                                               "every": 0, "every_s": 0.0, "final_version": 60, **kw})
    assert [v for v in range(1, 61) if due(v, every=20)] == [20, 40, 60]
    assert not due(5, every_s=300.0) and due(5, every_s=300.0, now=301.0)
    assert [v for v in range(1, 61) if due(v)] == [60]                  # both off: only the end
    assert not due(4, last_version=4, every=2)                           # never twice for a version


def test_checkpoint_event_only_after_orbax_commits(tmp_path):
    """`committed()` reports a save once its folder is committed; a process killed right after
    `save()` returned (orbax still writing) leaves no checkpoint: the next start ignores and
    removes the temporary folder, and the learner, which logs "checkpoint" from `committed()`,
    never logged one for it."""
    code = textwrap.dedent(f"""
        import os, signal, sys
        import jax.numpy as jnp
        from laminar_jax.runtime.checkpoint import Checkpointer
        ck = Checkpointer({str(tmp_path)!r})
        state = {{"w": jnp.ones((4096, 4096))}}
        ck.save(1, state, {{"version": 1}})
        print(ck.committed(wait=True)[0]["version"], flush=True)        # committed: reported
        ck.save(2, {{"w": state["w"] * 2}}, {{"version": 2}})
        os.kill(os.getpid(), signal.SIGKILL)                              # orbax still writing v2
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180,
                          cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu"))
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert proc.stdout.split() == ["1"], proc.stdout + proc.stderr
    assert [p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith("2.")], \
        "the kill should land mid-save (v2's temporary folder)"
    from laminar_jax.runtime.checkpoint import Checkpointer
    ck = Checkpointer(str(tmp_path))
    assert ck.latest() == 1 and run_folder.checkpoints(str(tmp_path)) == [1]
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if "tmp" in p.name]
    ck.close()


def test_a_store_named_after_another_process_is_removed_once_its_learner_is_gone(tmp_path):
    """`Fleet.start` names the store after the driver (alive all run): `remove_store(pid=...)`
    waits on the learner's process instead, and removes only a folder of published versions."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    store = tmp_path / f"run-ab12cd-{os.getpid()}"
    (store / "v0000000002").mkdir(parents=True)
    assert not run_folder.remove_store(str(store), pid=os.getpid(), wait_s=0.2)   # learner alive: kept
    assert store.exists() and run_folder.clean_stale_stores(str(tmp_path)) == []   # named after a live pid
    assert run_folder.remove_store(str(store), pid=dead.pid) and not store.exists()
    other = tmp_path / f"run-ef34ab-{os.getpid()}"
    (other / "notes.txt").mkdir(parents=True)                                        # not only versions
    assert not run_folder.remove_store(str(other), pid=dead.pid) and other.exists()
