"""`laminar plot`: every panel of simulator run folders (two side by side) is a non-blank PNG."""
import pathlib

import numpy as np
import pytest

from laminar_jax import cli
from laminar_jax.plot import PANELS

REPO = pathlib.Path(__file__).resolve().parents[2]


def _ink(png: pathlib.Path) -> float:
    """Fraction of pixels that are not background white."""
    from matplotlib.image import imread
    img = imread(png)[..., :3]
    return float(np.mean(np.any(img < 0.95, axis=-1)))


@pytest.fixture(scope="module")
def sim_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("sim")
    assert cli.main(["simulate", str(REPO / "configs/sim/study_repack.yaml"), f"run.out_dir={out}",
                     "run.warmup_steps=1", "run.measure_steps=2"]) == 0
    return out / "study_repack" / "repack_128", out / "study_repack" / "no_repack_128"


def test_plot_writes_every_panel_for_simulator_runs_side_by_side(sim_runs, tmp_path, capsys):
    assert cli.main(["plot", *map(str, sim_runs), "--out", str(tmp_path)]) == 0
    written = capsys.readouterr().out.split()
    assert written == [str(tmp_path / f"{p}.png") for p in PANELS]
    blank = {}
    for panel in PANELS:
        png = tmp_path / f"{panel}.png"
        assert png.stat().st_size > 10_000
        blank[panel] = _ink(png)
    # the data panels carry lines / bars, not just axes (reward: the simulator has none, and says so)
    assert all(blank[p] > 0.01 for p in ("throughput", "staleness", "kv", "repack", "idle")), blank
    assert cli.main(["plot", str(sim_runs[0]), "--panels", "kv"]) == 0   # one run: into RUN/plots/
    assert [p.name for p in (sim_runs[0] / "plots").iterdir()] == ["kv.png"]


def test_plot_errors_are_one_line(tmp_path, capsys):
    assert cli.main(["plot", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / 'nope'}: no such run folder"
    (tmp_path / "r" / "metrics").mkdir(parents=True)
    assert cli.main(["plot", str(tmp_path / "r"), "--panels", "reward,colour"]) == 2
    assert "--panels: unknown ['colour']" in capsys.readouterr().err
