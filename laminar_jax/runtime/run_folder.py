"""Run-folder safety: what an existing folder means for a new `laminar train`, the resume command
a crash prints, and the weight-store folders crashed runs leave in /dev/shm.

    plan(cfg, run_dir)             before anything starts: fresh run, resume, or a clear refusal
    resume_hint(cfg, args)         the exact command that resumes (or restarts) a crashed run
    clean_stale_stores(store_dir)  remove `<name>-<pid>` weight stores whose process is dead

`run.resume` (RunConfig): auto resumes a folder made with the same config (keys in RESUME_SAFE
may differ: more steps, another log cadence), and refuses one made with a different config;
never refuses any folder holding a run; force resumes regardless, keeping the old config.yaml
as config.<time>.yaml. No jax or ray import: this runs before either starts.
"""
from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
import time
from typing import Any, Sequence

from laminar_jax.config_loader import ConfigError, dump_config, yaml_load
from laminar_jax.runfiles import CONFIG_FILE, METRICS_DIR, METRICS_FILE

# keys that may change between a run and its resumption: they change neither the maths nor the data
RESUME_SAFE = frozenset({"run.name", "run.out_dir", "run.steps", "run.log_every", "run.resume",
                         "run.checkpoint_every", "run.checkpoint_every_s", "run.trackers",
                         "run.ray_address",
                         "learner.hosts"})   # a checkpoint restores onto any host count (learner_group)


@dataclasses.dataclass(frozen=True)
class Plan:
    resume: bool                 # the learner restores the latest checkpoint (if any)
    checkpoint: int | None       # its version (None: start from step 0)
    note: str                    # one line for the console


def checkpoints(run_dir: str) -> list[int]:
    """Committed checkpoint versions in `run_dir/checkpoints` (orbax commits by renaming its
    temporary folder to the bare version number), ascending."""
    folder = os.path.join(run_dir, "checkpoints")
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    return sorted(int(n) for n in names if n.isdigit() and os.path.isdir(os.path.join(folder, n)))


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}." if isinstance(v, dict) else f"{prefix}{k}"))
    return out


def config_diff(old: dict, new: dict, *, run_dir: str) -> list[str]:
    """'key: old -> new' for every key outside RESUME_SAFE whose value differs."""
    a, b = _flat(old), _flat(new)
    warm = os.path.join(run_dir, "sft", "sft_model")
    out = []
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key, "<absent>"), b.get(key, "<absent>")
        if key in RESUME_SAFE or va == vb:
            continue
        if key == "model.hf_path" and vb is None and _same_path(va, warm):
            continue  # the run's own warm-up model replaced hf_path: null in the stored config
        if isinstance(va, (list, tuple)) and isinstance(vb, (list, tuple)) and list(va) == list(vb):
            continue
        out.append(f"{key}: {va!r} -> {vb!r}")
    return out


def _same_path(a: Any, b: str) -> bool:
    return isinstance(a, str) and os.path.abspath(a) == os.path.abspath(b)


def _holds_run(run_dir: str) -> bool:
    return (os.path.isfile(os.path.join(run_dir, CONFIG_FILE))
            or os.path.isdir(os.path.join(run_dir, METRICS_DIR))
            or os.path.isfile(os.path.join(run_dir, METRICS_FILE)) or bool(checkpoints(run_dir)))


def plan(cfg: Any, run_dir: str) -> Plan:
    """Decide, before Ray or the warm-up starts, whether this run resumes `run_dir`; raises
    ConfigError (exit code 2) with what to do when it must not touch the folder."""
    mode = cfg.run.resume
    if not _holds_run(run_dir):
        return Plan(resume=False, checkpoint=None, note=f"new run folder {run_dir}")
    versions = checkpoints(run_dir)
    latest = versions[-1] if versions else None
    what = f"run folder {run_dir} already holds a run" + (f" (checkpoint v{latest})" if latest else "")
    if mode == "never":
        raise ConfigError(f"run.resume=never: {what}; choose another run.name, delete the folder, "
                          f"or pass run.resume=auto to resume it")
    cfg_path = os.path.join(run_dir, CONFIG_FILE)
    old = yaml_load(open(cfg_path).read()) if os.path.isfile(cfg_path) else None
    diff = config_diff(old, dump_config(cfg), run_dir=run_dir) if isinstance(old, dict) else ["config.yaml missing"]
    if diff and mode == "auto":
        shown = "; ".join(diff[:5]) + (f"; and {len(diff) - 5} more" if len(diff) > 5 else "")
        raise ConfigError(f"run.resume=auto: {what} made with a different config ({shown}); choose "
                          f"another run.name (or delete the folder) to start fresh, or pass "
                          f"run.resume=force to resume it with the new config")
    if latest is not None and latest >= cfg.run.steps:
        raise ConfigError(f"run.steps={cfg.run.steps}: {what}, which already reached step {latest}; "
                          f"raise run.steps to train on, or choose another run.name for a new run")
    if diff:  # force: keep the config the folder was made with beside the new one
        if os.path.isfile(cfg_path):
            shutil.copy(cfg_path, os.path.join(run_dir, f"config.{time.strftime('%Y%m%d-%H%M%S')}.yaml"))
        note = f"run.resume=force: resuming {run_dir} with a different config ({len(diff)} keys)"
    else:
        note = (f"resuming {run_dir} from checkpoint v{latest}" if latest is not None
                else f"restarting {run_dir} from step 0 (it has no committed checkpoint)")
    return Plan(resume=True, checkpoint=latest, note=note)


def resume_hint(cfg: Any, args: Sequence[str]) -> str:
    """The console lines after a crash: what the folder keeps and the exact command to go on."""
    run_dir = os.path.join(cfg.run.out_dir, cfg.run.name)
    # the same command resumes: config.yaml holds its config (never would refuse the folder)
    if cfg.run.resume == "never":
        args = [a for a in args if not a.startswith("run.resume=")] + ["run.resume=auto"]
    command = shlex.join(["laminar", "train", *args])
    versions = checkpoints(run_dir)
    if versions:
        return (f"the run folder {run_dir} keeps checkpoint v{versions[-1]}; resume with:\n"
                f"  {command}")
    return f"no checkpoint was committed in {run_dir}; this command starts the run over:\n  {command}"


_STORE = re.compile(r"^.+-(\d+)$")
_STORE_ENTRY = re.compile(r"^v\d{10}(\..*)?$")  # published versions and their orbax temporaries


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale_stores(store_dir: str) -> list[str]:
    """Remove the weight stores `<store_dir>/<run name>-<pid>` whose learner process is dead
    (a crash, or a `ray.kill`); returns the paths removed. Only folders that hold nothing but
    published versions are touched. A store lives on its learner's host, so the pid is checked
    there (this runs on that host: at the learner's start and at the driver's exit)."""
    try:
        names = os.listdir(store_dir)
    except (FileNotFoundError, NotADirectoryError):
        return []
    removed = []
    for name in names:
        m = _STORE.match(name)
        path = os.path.join(store_dir, name)
        if m is None or not os.path.isdir(path) or _alive(int(m.group(1))):
            continue
        try:
            entries = os.listdir(path)
        except OSError:
            continue
        if all(_STORE_ENTRY.match(e) for e in entries):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def remove_store(root: str, *, wait_s: float = 15.0, pid: int | None = None) -> bool:
    """Remove the run's own weight store once its learner process is gone (a killed actor takes a
    moment to exit); True when removed. Waits at most `wait_s`; a store whose process lives on is
    left for `clean_stale_stores` at the next start. pid: the learner's process when the name
    carries another one (`Fleet.start` names the store after the driver, before the learner runs)."""
    m = _STORE.match(os.path.basename(root))
    if m is None or not os.path.isdir(root):
        return False
    owner = int(m.group(1)) if pid is None else pid
    deadline = time.time() + wait_s
    while _alive(owner):
        if time.time() > deadline:
            return False
        time.sleep(0.1)
    if owner == int(m.group(1)):
        return str(root) in clean_stale_stores(os.path.dirname(root))
    try:
        entries = os.listdir(root)
    except OSError:
        return False
    if not all(_STORE_ENTRY.match(e) for e in entries):
        return False
    shutil.rmtree(root, ignore_errors=True)
    return True
