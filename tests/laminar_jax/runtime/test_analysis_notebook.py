"""experiments/analysis.ipynb runs top to bottom (nbclient) on a fresh short real run and a
simulator run, and is stored without outputs."""
import os
import pathlib

import pytest

from laminar_jax import cli
from laminar_jax.plot import PANELS

REPO = pathlib.Path(__file__).resolve().parents[3]
NOTEBOOK = REPO / "experiments" / "analysis.ipynb"


def test_notebook_is_stored_without_outputs():
    import nbformat
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.outputs == [] and c.execution_count is None for c in code)


@pytest.mark.slow
def test_notebook_executes_on_a_fresh_real_run_and_a_simulator_run(shared_run, tmp_path):
    import nbclient
    import nbformat
    # the package's shared run (conftest.shared_run, also test_modes_train's and test_multinode's):
    # checkpointed by time only, a tiny interval, so every step is due (run.checkpoint_every_s is read)
    cfg, summary = shared_run
    real = summary["run_dir"]
    from laminar_jax.analysis import load_run
    events = load_run(real).events
    assert sorted(events[events.kind == "checkpoint"].version) == list(range(1, cfg.run.steps + 1))
    assert cli.main(["simulate", str(REPO / "configs/sim/study_repack.yaml"), f"run.out_dir={tmp_path / 'sim'}",
                     "run.warmup_steps=1", "run.measure_steps=2"]) == 0
    env = {"LAMINAR_RUN": real, "LAMINAR_SIM_RUN": str(tmp_path / "sim" / "study_repack" / "repack_128"),
           "LAMINAR_PLOTS": str(tmp_path / "plots"), "PYTHONPATH": str(REPO)}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the kernel inherits them
    try:
        nb = nbformat.read(NOTEBOOK, as_version=4)
        nbclient.NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(REPO)}}).execute()
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert f"{cfg.run.name}: {cfg.run.steps} steps" in text and "exact answers:" in text
    images = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) == len(PANELS)
    assert all((tmp_path / "plots" / f"{p}.png").stat().st_size > 10_000 for p in PANELS)
