"""The `laminar` command: jax-free help and config paths, dispatch, and one-line config errors."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import types

import pytest

from laminar_jax import cli
from laminar_jax.config import Config, config_from_dict, load_config, yaml_load

REPO = pathlib.Path(__file__).resolve().parents[2]
HEAVY = ("jax", "jaxlib", "ray", "torch", "flax", "optax", "orbax")

# Runs `main(argv)` in a fresh interpreter and reports the exit code and which heavy modules the
# process imported; the code is printed on stdout's last line as JSON.
_PROBE = """
import json, sys
from laminar_jax.cli import main
try:
    rc = main(sys.argv[1:])
except SystemExit as e:
    rc = e.code
heavy = sorted(m for m in {heavy!r} if m in sys.modules)
print(json.dumps({{"rc": rc, "heavy": heavy}}))
"""


def _probe(args, cwd=REPO):
    proc = subprocess.run([sys.executable, "-c", _PROBE.format(heavy=HEAVY), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    return report, proc.stdout, proc.stderr


def test_help_imports_no_heavy_module():
    report, out, err = _probe(["--help"])
    assert report == {"rc": 0, "heavy": []}, err
    for command in ("config", "sft", "train", "simulate"):
        assert command in out


def test_config_show_and_config_errors_import_no_heavy_module(tmp_path):
    report, out, _ = _probe(["config", "show", "configs/default.yaml", "optimizer.lr=1e-6"])
    assert report == {"rc": 0, "heavy": []}
    bad = tmp_path / "bad.yaml"
    bad.write_text("optimizer:\n  lr: fast\n")
    for command in ("train", "sft"):
        report, _, err = _probe([command, str(bad)])
        assert report == {"rc": 2, "heavy": []}
        assert err == f"error: {bad}: optimizer.lr: expected float, got 'fast'\n"


def test_module_entry_point_exit_code(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("optimizer:\n  lrr: 1\n")
    proc = subprocess.run([sys.executable, "-m", "laminar_jax.cli", "config", "show", str(bad)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr == f"error: {bad}: optimizer.lrr: unknown key; did you mean 'optimizer.lr'?\n"
    assert proc.stdout == ""


def test_config_show_prints_the_resolved_config_with_overrides(capsys):
    overrides = ["optimizer.lr=1e-6", "manager.mode=sync", "loss.correction.old=prox", "loss.correction.is_level=token"]
    assert cli.main(["config", "show", str(REPO / "configs/default.yaml"), *overrides]) == 0
    shown = yaml_load(capsys.readouterr().out)
    assert shown["optimizer"]["lr"] == 1e-6 and shown["manager"]["mode"] == "sync"
    assert config_from_dict(shown) == load_config(REPO / "configs/default.yaml", overrides)


def test_bad_override_exits_2_with_one_line(capsys):
    rc = cli.main(["config", "show", str(REPO / "configs/default.yaml"), "mesh.dataa=2"])
    assert rc == 2
    err = capsys.readouterr().err
    assert err == (f"error: {REPO / 'configs/default.yaml'}: override 'mesh.dataa=2': "
                   "mesh.dataa: unknown key; did you mean 'mesh.data'?\n")


def _fake_module(monkeypatch, name, **attrs):
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    monkeypatch.setitem(sys.modules, name, module)
    return module


@pytest.mark.parametrize("command, module", [
    ("sft", "laminar_jax.learner.sft"), ("train", "laminar_jax.runtime.driver")])
def test_sft_and_train_hand_the_loaded_config_to_run(monkeypatch, tmp_path, command, module):
    received = []
    _fake_module(monkeypatch, module, run=lambda cfg, **kw: received.append(cfg))
    path = tmp_path / "c.yaml"
    path.write_text("run:\n  steps: 7\n")
    assert cli.main([command, str(path), "optimizer.lr=0.25"]) == 0
    (cfg,) = received
    assert isinstance(cfg, Config)
    assert (cfg.run.steps, cfg.optimizer.lr) == (7, 0.25)


def test_default_config_is_found_from_cwd_then_repo_root(monkeypatch, tmp_path):
    received = []
    _fake_module(monkeypatch, "laminar_jax.learner.sft", run=received.append)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["sft", "run.steps=3"]) == 0  # no configs/ here: the repo's default
    assert received.pop() == load_config(REPO / "configs/default.yaml", ["run.steps=3"])
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs/default.yaml").write_text("run:\n  name: local\n")
    assert cli.main(["sft"]) == 0
    assert received.pop().run.name == "local"


def test_simulate_passes_path_and_overrides(monkeypatch):
    calls = []

    def main(config_path, overrides):
        calls.append((config_path, list(overrides)))
        return 3

    _fake_module(monkeypatch, "laminar_jax.sim.cli", main=main)
    assert cli.main(["simulate", "configs/sim/x.yaml", "fleet.size=4"]) == 3
    assert calls == [("configs/sim/x.yaml", ["fleet.size=4"])]


def test_missing_module_is_a_clear_usage_error_and_real_import_errors_propagate(
        monkeypatch, tmp_path):
    with pytest.raises(cli._Usage, match=r"the thing is not built yet \(laminar_jax\.nope\.run "
                                         r"does not exist\)"):
        cli._import_entry("laminar_jax.nope.run", "run", "the thing")
    # A module that exists but needs a missing dependency must not pass for "not built yet".
    (tmp_path / "broken_entry_mod.py").write_text("import dependency_that_is_not_there_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="dependency_that_is_not_there_xyz"):
        cli._import_entry("broken_entry_mod", "run", "broken")


def _raise_missing(name):
    raise ModuleNotFoundError(f"No module named {name!r}", name=name)


def test_train_without_runtime_exits_2(monkeypatch, capsys):
    # Make the runtime module unimportable whether or not it exists in the tree.
    monkeypatch.setattr(cli.importlib, "import_module", _raise_missing)
    assert cli.main(["train", str(REPO / "configs/default.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the RL runtime is not built yet") and err.count("\n") == 1


def test_config_show_requires_a_config(capsys):
    assert cli.main(["config", "show", "optimizer.lr=1"]) == 2
    assert "a CONFIG path is required" in capsys.readouterr().err
