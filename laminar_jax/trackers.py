"""Metric trackers behind one interface (`run.trackers`): TensorBoard and Weights & Biases.

    tracker.log_scalars(step, {"loss": 0.5, ...});  tracker.flush();  tracker.close()

The Parquet files stay the record of a run; trackers are views of its numeric metrics.
tensorboard writes event files under `<run_dir>/tb/` (tensorboardX; `tensorboard --logdir
runs/` shows them, the `tensorboard` package comes with the dev extra). wandb writes under
`<run_dir>/wandb/` in offline mode unless WANDB_MODE is set (`wandb sync <run_dir>/wandb/offline-run-*`
uploads it later), so a run never needs a network or an account. No jax import.
"""
from __future__ import annotations

import os
import pathlib
import sys
from typing import Any, Mapping, Sequence

from laminar_jax.runfiles import TB_DIR, WANDB_DIR


def _import_tensorboardx():
    # tensorboardX.writer imports torch when it is installed (for a type check only); laminar_jax
    # must not pull torch in, so hide it during the import unless something else loaded it.
    hide = "torch" not in sys.modules
    if hide:
        sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        import tensorboardX
    finally:
        if hide and sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]
    return tensorboardX


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, run_dir: pathlib.Path, config: Any = None):
        self._w = _import_tensorboardx().SummaryWriter(logdir=str(run_dir / TB_DIR))

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        for key, value in scalars.items():
            self._w.add_scalar(key, value, global_step=step)

    def flush(self) -> None:
        self._w.flush()

    def close(self) -> None:
        self._w.close()


class WandbTracker:
    """One W&B run per writer, offline unless WANDB_MODE says otherwise."""

    name = "wandb"

    def __init__(self, run_dir: pathlib.Path, config: Any = None):
        try:
            import wandb
        except ImportError:
            raise RuntimeError("run.trackers lists wandb, but the wandb package is not installed "
                               "(pip install wandb, or the dev extra)") from None
        from laminar_jax.config_loader import dump_config
        folder = run_dir / WANDB_DIR
        folder.mkdir(parents=True, exist_ok=True)
        try:
            cfg = dump_config(config) if config is not None and not isinstance(config, dict) else config
        except Exception:  # a config that is not one of ours: log none
            cfg = None
        self._wandb = wandb
        self._run = wandb.init(dir=str(run_dir), project=os.environ.get("WANDB_PROJECT", "laminar-jax"),
                               name=run_dir.name, config=cfg, mode=os.environ.get("WANDB_MODE", "offline"),
                               settings=wandb.Settings(console="off", silent=True),
                               reinit="create_new")

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        self._run.log(dict(scalars), step=step)

    def flush(self) -> None:
        pass  # the W&B service process writes as it goes

    def close(self) -> None:
        self._run.finish()


TRACKERS = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker}


def make_trackers(names: Sequence[str], run_dir: pathlib.Path, config: Any = None) -> list:
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise ValueError(f"trackers: unknown {unknown}; known: {sorted(TRACKERS)}")
    return [TRACKERS[n](pathlib.Path(run_dir), config) for n in names]
