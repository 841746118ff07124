"""The supervised warm-up of a `laminar train` that starts from a preset (no `model.hf_path`):
`laminar sft` in a process of its own, started while Ray starts.

Its own process, as every actor has one: the driver imports no jax, and the warm-up gets the
XLA flags an actor gets (`cluster.actor_options`: the mesh's host devices), not whatever the
driver's process carries. On a thread of the driver it inherited them: under the test suite's
in-process `--xla_backend_optimization_level=0` it ran 2.7x slower (100 countdown steps: 6.9k
against 18.5k tokens/s). Its output goes to the driver's console as before.
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from typing import Any

from laminar_jax.config_loader import dump_yaml
from laminar_jax.runtime.cluster import xla_flags
from laminar_jax.runtime.learner_group import mesh_devices

GRACE_S = 5.0        # a stopped warm-up gets SIGTERM, then SIGKILL after this
TIMEOUT_S = 3600.0   # the whole warm-up (sft.steps steps); past it: an error


def model_dir(run_dir: str) -> str:
    """Where the warm-up of the run in `run_dir` writes its model (`laminar sft`'s layout)."""
    return os.path.join(run_dir, "sft", "sft_model")


def sft_config(cfg: Any, run_dir: str) -> Any:
    """`cfg` as `laminar sft` of `run_dir` runs it: it writes to <out_dir>/<name>/sft."""
    run_dir = os.path.abspath(run_dir)
    return dataclasses.replace(cfg, run=dataclasses.replace(
        cfg.run, out_dir=os.path.dirname(run_dir), name=os.path.basename(run_dir),
        log_every=max(1, cfg.sft.steps // 10)))


def _env(cfg: Any) -> dict[str, str]:
    return dict(os.environ, XLA_FLAGS=xla_flags(mesh_devices(cfg)))


class WarmUp:
    """`laminar sft` of `cfg` into `model_dir(run_dir)`, in a child process; `result(timeout)`
    waits for it. An existing model there is reused (e.g. made by `laminar sft` with the same
    run name): then nothing runs. `output`: a file for the child's stdout and stderr (default:
    this process's console)."""

    def __init__(self, cfg: Any, run_dir: str, *, announce: bool = True, output: Any = None):
        self.model_dir = model_dir(run_dir)
        self.proc: subprocess.Popen | None = None
        self.output_path = getattr(output, "name", None)
        if os.path.exists(os.path.join(self.model_dir, "config.json")):
            return
        sft_cfg = sft_config(cfg, run_dir)
        os.makedirs(os.path.join(run_dir, "sft"), exist_ok=True)
        self.config_path = os.path.join(run_dir, "sft", "warm_up.yaml")
        with open(self.config_path, "w") as f:
            f.write(dump_yaml(sft_cfg))
        if announce:
            print(f"warm-up: {cfg.sft.steps} supervised steps on {cfg.data.task} before RL", flush=True)
        self.proc = subprocess.Popen([sys.executable, "-m", "laminar_jax.cli", "sft", self.config_path],
                                     env=_env(cfg), stdin=subprocess.DEVNULL, stdout=output,
                                     stderr=None if output is None else subprocess.STDOUT)

    def result(self, timeout: float = TIMEOUT_S) -> str:
        """The model folder once the warm-up is done; TimeoutError (the warm-up stopped) past
        `timeout` s; RuntimeError naming the exit code if it failed (its traceback is above)."""
        if self.proc is None:
            return self.model_dir
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise TimeoutError(f"the supervised warm-up (sft.steps) did not finish within {timeout:.0f} s") from None
        if code != 0 or not os.path.exists(os.path.join(self.model_dir, "config.json")):
            where = f"in {self.output_path}" if self.output_path else "printed above"
            raise RuntimeError(f"the supervised warm-up (`laminar sft {self.config_path}`) failed with exit code "
                               f"{code}; its error is {where}")
        return self.model_dir

    def stop(self) -> None:
        """Ends a warm-up still running (the run stopped before it finished)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        deadline = time.monotonic() + GRACE_S
        while self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(GRACE_S)


def run(cfg: Any, run_dir: str) -> str:
    """Runs the warm-up to its end; returns its model folder."""
    return WarmUp(cfg, run_dir).result()
