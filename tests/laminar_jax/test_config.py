"""Config loader: every shipped YAML loads, errors name file + dotted key, overrides, round trips."""
from __future__ import annotations

import dataclasses
import pathlib
import re
from typing import Literal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from laminar_jax.config import (Config, ConfigError, LossSpec, config_from_dict, dump_config,
                                dump_yaml, load_config, yaml_load)

REPO = pathlib.Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").rglob("*.yaml"))


def _is_sim(path: pathlib.Path) -> bool:
    return "sim" in path.relative_to(REPO / "configs").parts[:-1]


def _schema_for(path: pathlib.Path):
    if _is_sim(path):
        from laminar_jax.sim.config import SimConfig
        return SimConfig
    return Config


def _load_shipped(path: pathlib.Path):
    """Simulator scenarios may start from a `base:` file, which only `load_sim_config` resolves."""
    if _is_sim(path):
        from laminar_jax.sim.config import load_sim_config
        return load_sim_config(path)
    return load_config(path)


def _write(tmp_path: pathlib.Path, text: str, name: str = "x.yaml") -> pathlib.Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _error(path, overrides=(), schema=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides, schema)
    return str(info.value)


# ------------------------------------------------------------------ shipped configs

def test_configs_exist():
    names = {p.relative_to(REPO / "configs").as_posix() for p in CONFIGS}
    assert "default.yaml" in names
    assert sum(n.startswith("ablations/") for n in names) >= 2


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_config_loads_and_round_trips(path, tmp_path):
    schema = _schema_for(path)
    cfg = _load_shipped(path)
    assert isinstance(cfg, schema)
    text = dump_yaml(cfg)
    assert config_from_dict(yaml_load(text), schema=schema) == cfg
    assert load_config(_write(tmp_path, text), schema=schema) == cfg


def test_default_yaml_documents_the_dataclass_defaults():
    # Other configs list only their changes, so default.yaml must mean exactly Config().
    assert load_config(REPO / "configs/default.yaml") == Config()
    written = yaml_load((REPO / "configs/default.yaml").read_text())
    assert written == dump_config(Config()), "default.yaml must spell out every key"


def test_ablations_change_the_loss_only_through_yaml():
    tis = load_config(REPO / "configs/ablations/decoupled_tis.yaml")
    icepop = load_config(REPO / "configs/ablations/bypass_icepop.yaml")
    assert (tis.loss.correction.old, tis.loss.correction.is_level) == ("prox", "token")
    assert tis.loss.needs_prox
    assert icepop.loss.correction.old == "behaviour" and not icepop.loss.needs_prox
    assert icepop.loss.correction.reject_level == "token"
    assert tis.loss != LossSpec() and icepop.loss != LossSpec()


# ------------------------------------------------------------------ error messages

def test_unknown_key_suggests_the_closest(tmp_path):
    path = _write(tmp_path, "optimizer:\n  lrr: 0.1\n")
    assert _error(path) == f"{path}: optimizer.lrr: unknown key; did you mean 'optimizer.lr'?"


def test_unknown_key_without_close_match_lists_the_keys(tmp_path):
    path = _write(tmp_path, "mesh:\n  zzzzzz: 2\n")
    assert _error(path) == f"{path}: mesh.zzzzzz: unknown key; valid keys: data, fsdp, tensor"


def test_unknown_section(tmp_path):
    path = _write(tmp_path, "optimiser:\n  lr: 0.1\n")
    assert _error(path) == f"{path}: optimiser: unknown section; did you mean 'optimizer'?"


def test_unknown_key_in_a_nested_spec(tmp_path):
    path = _write(tmp_path, "loss:\n  correction:\n    is_maxx: 3.0\n")
    assert _error(path) == (f"{path}: loss.correction.is_maxx: unknown key; "
                            "did you mean 'loss.correction.is_max'?")


@pytest.mark.parametrize("text, message", [
    ("optimizer:\n  lr: abc\n", "optimizer.lr: expected float, got 'abc'"),
    ("run:\n  seed: true\n", "run.seed: expected int, got True"),
    ("run:\n  seed: 1.5\n", "run.seed: expected int, got 1.5"),
    ("learner:\n  recompute_prox: 1\n", "learner.recompute_prox: expected bool (true/false), got 1"),
    ("run:\n  name: 5\n", "run.name: expected str, got 5"),
    ("run:\n  ray_address: 5\n", "run.ray_address: expected str | null, got 5"),
    ("manager:\n  mode: fast\n",
     "manager.mode: expected one of 'sync', 'one_step', 'stream', 'partial', 'laminar', got 'fast'"),
    ("optimizer: 3\n", "optimizer: expected a mapping (OptimizerConfig), got 3"),
    ("loss:\n  surrogate: [1]\n", "loss.surrogate: expected a mapping (SurrogateSpec), got [1]"),
])
def test_wrong_type_names_file_key_and_expectation(tmp_path, text, message):
    path = _write(tmp_path, text)
    assert _error(path) == f"{path}: {message}"


@pytest.mark.parametrize("text, key, expected", [
    ("optimizer:\n  lr: -1\n", "optimizer.lr", "> 0"),
    ("optimizer:\n  b2: 1.0\n", "optimizer.b2", "0 <= value < 1"),
    ("mesh:\n  data: 0\n", "mesh.data", "-1"),
    ("data:\n  group_size: 0\n", "data.group_size", ">= 1"),
    ("manager:\n  c_max: 1.5\n", "manager.c_max", "0 < c_max <= 1"),
    ("rollout:\n  top_p: 0\n", "rollout.top_p", "0 < top_p <= 1"),
    ("learner:\n  mini_batches: 3\n", "learner.mini_batches", "divisor of global_batch_groups (8)"),
    ("loss:\n  surrogate:\n    eps_low: -0.1\n", "loss.surrogate.eps_low", ">= 0"),
    ("advantage:\n  estimator: ppo\n", "advantage.estimator", "grpo"),
    ("optimizer:\n  warmup_steps: 80\n", "optimizer.warmup_steps", "run.steps (60)"),
    ("data:\n  path: rows.jsonl\n", "reward.fn", "'task' scores only the built-in tasks' rows"),
    ("sft:\n  demo_noise: 1.0\n", "sft.demo_noise", "[0, 1)"),
    ("model:\n  vocab_size: -1\n", "model.vocab_size", ">= 0"),
])
def test_out_of_range_names_file_and_dotted_key(tmp_path, text, key, expected):
    path = _write(tmp_path, text)
    message = _error(path)
    assert re.match(rf"^{re.escape(str(path))}: {re.escape(key)}\b", message), message
    assert expected in message


def test_range_error_from_an_override_names_the_override(tmp_path):
    path = _write(tmp_path, "optimizer:\n  lr: 0.1\n")
    message = _error(path, ["optimizer.lr=-2"])
    assert message.startswith(f"{path}: override 'optimizer.lr=-2': optimizer.lr: ")
    assert "got -2.0" in message


def test_file_level_errors(tmp_path):
    assert _error(tmp_path / "missing.yaml") == f"{tmp_path / 'missing.yaml'}: no such config file"
    bad = _write(tmp_path, "run: [unclosed\n")
    assert _error(bad).startswith(f"{bad}: invalid YAML")
    listed = _write(tmp_path, "- 1\n- 2\n")
    assert _error(listed) == f"{listed}: expected a mapping of sections at the top level, got list"


def test_empty_file_and_missing_keys_take_defaults(tmp_path):
    assert load_config(_write(tmp_path, "")) == Config()
    cfg = load_config(_write(tmp_path, "optimizer:\n  lr: 0.5\n"))
    assert cfg.optimizer.lr == 0.5 and cfg.optimizer.b1 == 0.9 and cfg.run == Config().run


def test_yaml_12_floats(tmp_path):
    cfg = load_config(_write(tmp_path, "optimizer:\n  lr: 1e-6\n  eps: 3E-9\n"))
    assert cfg.optimizer.lr == 1e-6 and cfg.optimizer.eps == 3e-9
    # ints are accepted for floats and become floats
    cfg = load_config(_write(tmp_path, "optimizer:\n  lr: 2\n"))
    assert cfg.optimizer.lr == 2.0 and type(cfg.optimizer.lr) is float


# ------------------------------------------------------------------ overrides

def test_overrides_apply_over_the_file(tmp_path):
    path = _write(tmp_path, "optimizer:\n  lr: 0.1\nmesh:\n  fsdp: 2\n  tensor: 2\n")
    cfg = load_config(path, [
        "optimizer.lr=1e-6", "learner.recompute_prox=true", "mesh={data: -1, tensor: 4}",
        "run.name=001", "run.ray_address=auto", "loss.correction.is_max=null",
        "loss.surrogate.kind=gspo", "optimizer.lr=2e-6",
    ])
    assert cfg.optimizer.lr == 2e-6  # the later override wins
    assert cfg.learner.recompute_prox is True
    assert (cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor) == (-1, 2, 4)  # a mapping merges
    assert cfg.run.name == "001"  # a str field keeps the text as typed
    assert cfg.run.ray_address == "auto"
    assert cfg.loss.correction.is_max is None
    assert cfg.loss.surrogate.kind == "gspo"


def test_overrides_without_a_file():
    cfg = load_config(None, ["run.steps=3"])
    assert cfg == dataclasses.replace(Config(), run=dataclasses.replace(Config().run, steps=3))


@pytest.mark.parametrize("override, message", [
    ("lr", "override 'lr': expected KEY=VALUE with a dotted key, e.g. optimizer.lr=1e-6"),
    ("optimizer..lr=1", "override 'optimizer..lr=1': expected KEY=VALUE"),
    ("optimizer.lr=abc", "override 'optimizer.lr=abc': optimizer.lr: expected float, got 'abc'"),
    ("optimizer.lrr=1", "override 'optimizer.lrr=1': optimizer.lrr: unknown key; "
                        "did you mean 'optimizer.lr'?"),
    ("optimiser.lr=1", "override 'optimiser.lr=1': optimiser: unknown section; "
                       "did you mean 'optimizer'?"),
    ("optimizer.lr.x=1", "override 'optimizer.lr.x=1': optimizer.lr is a float, not a section"),
    ("mesh=3", "override 'mesh=3': mesh: expected a mapping (MeshConfig), got 3"),
    ("run.steps=[1, 2", "override 'run.steps=[1, 2': cannot parse value"),
])
def test_bad_overrides(tmp_path, override, message):
    path = _write(tmp_path, "")
    assert _error(path, [override]).startswith(f"{path}: {message}")


def test_overrides_must_be_a_sequence():
    with pytest.raises(TypeError, match="sequence"):
        load_config(None, "optimizer.lr=1")


# ------------------------------------------------------------------ the generic loader

@dataclasses.dataclass(frozen=True)
class _Inner:
    k: int = 1


@dataclasses.dataclass(frozen=True)
class _Schema:
    required: str
    sizes: tuple[int, ...] = ()
    pair: tuple[int, str] = (0, "a")
    maybe: float | None = None
    either: int | str = 0
    flag: Literal[True, "auto"] = "auto"
    inner: _Inner = dataclasses.field(default_factory=_Inner)
    opt_inner: _Inner | None = None

    def __post_init__(self):
        if any(s < 0 for s in self.sizes):
            raise ValueError(f"sizes: expected non-negative ints, got {self.sizes}")


def test_generic_schema_types(tmp_path):
    path = _write(tmp_path, "required: r\nsizes: [1, 2]\npair: [3, b]\nmaybe: 2\n"
                            "either: x\nflag: true\nopt_inner: {k: 5}\n")
    cfg = load_config(path, schema=_Schema)
    assert cfg == _Schema(required="r", sizes=(1, 2), pair=(3, "b"), maybe=2.0, either="x",
                          flag=True, opt_inner=_Inner(5))
    assert config_from_dict(yaml_load(dump_yaml(cfg)), schema=_Schema) == cfg
    over = load_config(path, ["sizes=[4]", "opt_inner.k=7", "maybe=null", "either=3"],
                       schema=_Schema)
    assert (over.sizes, over.opt_inner, over.maybe, over.either) == ((4,), _Inner(7), None, 3)


@pytest.mark.parametrize("text, message", [
    ("sizes: [1, two]\n", "sizes[1]: expected int, got 'two'"),
    ("sizes: 3\n", "sizes: expected a list of int, got 3"),
    ("pair: [1]\n", "pair: expected a list of 2 items (int, str), got [1]"),
    ("flag: 1\n", "flag: expected one of True, 'auto', got 1"),
    ("either: 1.5\n", "either: expected int | str, got 1.5"),
    ("maybe: no\n", "maybe: expected float | null, got False"),
    ("inner: {k: x}\n", "inner.k: expected int, got 'x'"),
    ("sizes: [-1]\n", "sizes: expected non-negative ints, got (-1,)"),
])
def test_generic_schema_errors(tmp_path, text, message):
    path = _write(tmp_path, "required: r\n" + text)
    assert _error(path, schema=_Schema) == f"{path}: {message}"


def test_missing_required_key(tmp_path):
    path = _write(tmp_path, "sizes: []\n")
    assert _error(path, schema=_Schema) == f"{path}: required: missing required key (expected str)"


# ------------------------------------------------------------------ round trip, property-based

_names = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1,
                 max_size=12).filter(lambda s: s.strip() and "/" not in s and s not in (".", ".."))


@settings(max_examples=60, deadline=None)
@given(name=_names,
       lr=st.floats(min_value=1e-12, max_value=10, allow_subnormal=False),
       b1=st.floats(min_value=0, max_value=0.999999),
       seed=st.integers(0, 2**62),
       data=st.sampled_from([-1, 1, 3]),
       is_max=st.one_of(st.none(), st.floats(min_value=1.0, max_value=100.0)),
       path=st.one_of(st.none(), st.sampled_from(["1e-6", "true", "null", "x.jsonl", "~"])))
def test_dump_then_load_is_identity(name, lr, b1, seed, data, is_max, path):
    base = Config()
    cfg = dataclasses.replace(
        base,
        run=dataclasses.replace(base.run, name=name, seed=seed),
        optimizer=dataclasses.replace(base.optimizer, lr=lr, b1=b1),
        mesh=dataclasses.replace(base.mesh, data=data),
        data=dataclasses.replace(base.data, path=path),
        reward=dataclasses.replace(base.reward, fn="task" if path is None else "exact_match"),
        loss=dataclasses.replace(base.loss, correction=dataclasses.replace(
            base.loss.correction, is_max=is_max)),
    )
    assert config_from_dict(yaml_load(dump_yaml(cfg))) == cfg


def _sections(schema: type, default, prefix: str = ""):
    """(dotted name, default instance) of every section and sub-section of the schema."""
    for f in dataclasses.fields(schema):
        value = getattr(default, f.name)
        if dataclasses.is_dataclass(value):
            name = f"{prefix}{f.name}"
            yield name, value
            yield from _sections(type(value), value, name + ".")


def _nest(dotted: str, leaf):
    data = leaf
    for part in reversed(dotted.split(".")):
        data = {part: data}
    return data


_ALL_SECTIONS = [name for name, _ in _sections(Config, Config())]


@pytest.mark.parametrize("section", _ALL_SECTIONS)
@pytest.mark.parametrize("empty", [{}, None], ids=["empty-mapping", "null"])
def test_a_named_section_without_keys_equals_the_defaults(section, empty):
    """One default per key: naming a section (or a sub-section) but none of its keys changes
    nothing, whatever the dataclass defaults of its type are (Config.loss is LossSpec with
    correction.old 'behaviour', LossSpec() alone has 'prox')."""
    assert config_from_dict(_nest(section, empty)) == Config()


def test_an_unrelated_loss_key_keeps_the_ppo_anchor(tmp_path):
    """Adding `loss: {surrogate: {kind: ppo}}` used to flip correction.old to LossSpec's 'prox'."""
    assert Config().loss.correction.old == "behaviour"
    cfg = load_config(_write(tmp_path, "loss:\n  surrogate: {kind: ppo}\n"))
    assert cfg.loss.correction.old == "behaviour"
    assert cfg == Config()
    cfg = load_config(_write(tmp_path, "loss:\n  correction: {is_max: 3.0}\n"))
    assert cfg.loss.correction == dataclasses.replace(Config().loss.correction, is_max=3.0)
    cfg = load_config(None, ["loss.entropy_coef=0.01"])
    assert cfg.loss.correction.old == "behaviour"


@pytest.mark.parametrize("override,check", [
    ("loss.surrogate.kind=sapo", lambda c: c.loss.surrogate.kind == "sapo"),
    ("loss.surrogate.sapo_tau_neg=2.0", lambda c: c.loss.surrogate.sapo_tau_neg == 2.0),
    ("loss.surrogate.kind=dppo", lambda c: c.loss.surrogate.kind == "dppo"),
    ("loss.correction.old=ewma", lambda c: c.loss.needs_ewma and c.loss.needs_prox),
    ("loss.correction.ewma_decay=0.5", lambda c: c.loss.correction.ewma_decay == 0.5),
    ("loss.log_entropy=false", lambda c: not c.loss.needs_entropy),
])
def test_new_loss_options_are_reachable_from_yaml(override, check, tmp_path):
    key, value = override.split("=")
    parts = key.split(".")
    text = "".join(f"{'  ' * i}{p}:\n" for i, p in enumerate(parts[:-1]))
    text += f"{'  ' * (len(parts) - 1)}{parts[-1]}: {value}\n"
    assert check(load_config(_write(tmp_path, text)))
    assert check(load_config(None, [override]))


@pytest.mark.parametrize("overrides, message", [
    (["rollout.num_rollouts=2"], "exactly one rollout with engine jax"),
    (["rollout.engine=vllm"], "exactly one rollout with engine jax"),
    (["run.ray_address=auto"], "no run.ray_address"),
    (["mesh.fsdp=2"], "a learner of one host on one device"),
    (["learner.memory_fraction=0.5"], "learner.memory_fraction null"),
])
def test_colocate_needs_one_jax_rollout_and_a_one_device_learner_without_ray(tmp_path, overrides, message):
    path = _write(tmp_path, "")
    assert load_config(path, ["run.colocate=true", "rollout.num_rollouts=1"]).run.colocate
    err = _error(path, ["run.colocate=true", "rollout.num_rollouts=1", *overrides])
    assert "run.colocate" in err and message in err, err
