"""Device mesh and logical-axis sharding rules.

Params carry logical axis names (``"vocab", "embed", "heads", "kv_heads", "head_dim", "mlp",
"norm", "layers"``) in their ``out_sharding`` metadata (flax 0.12 renamed ``sharding_names`` to
``out_sharding``; both spellings end up there). A rule table maps each logical name to a mesh axis
(or a tuple of mesh axes, or ``None`` for replicated); ``param_shardings`` turns a model's param
state into a pure-dict tree of ``NamedSharding`` that ``jax.jit`` takes as in/out shardings.

The mesh always has the three axes ``("data", "fsdp", "tensor")`` with ``AxisType.Auto``: jax 0.10
defaults ``make_mesh`` to Explicit axes, which would make every ambiguous op in the model need a
sharding annotation; Auto keeps classic GSPMD propagation from the in/out shardings.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from flax.nnx import traversals
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

MeshAxes = str | tuple[str, ...] | None
Rules = Sequence[tuple[str, MeshAxes]]

DEFAULT_RULES: tuple[tuple[str, MeshAxes], ...] = (
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("head_dim", None),
    ("norm", None),
    ("layers", None),
    # activations: the leading (sequence) dimension of every batch array
    ("batch", BATCH_AXES),
)


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1, *,
              devices: Sequence[Any] | None = None) -> Mesh:
    """Builds the ``("data", "fsdp", "tensor")`` mesh with Auto axes.

    ``data=-1`` takes all devices left after ``fsdp * tensor``. The product must divide the
    number of devices when ``data=-1`` and must not exceed it otherwise (the first devices are used).
    """
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    for name, size in (("fsdp", fsdp), ("tensor", tensor)):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"mesh.{name} must be an int >= 1, got {size!r}")
    if data == -1:
        if n % (fsdp * tensor):
            raise ValueError(
                f"mesh.data=-1 needs fsdp*tensor={fsdp * tensor} (fsdp={fsdp}, tensor={tensor}) "
                f"to divide the {n} available devices")
        data = n // (fsdp * tensor)
    elif not isinstance(data, int) or data < 1:
        raise ValueError(f"mesh.data must be -1 (all remaining devices) or an int >= 1, got {data!r}")
    size = data * fsdp * tensor
    if size > n:
        raise ValueError(f"mesh data={data} x fsdp={fsdp} x tensor={tensor} = {size} devices, "
                         f"but only {n} are available")
    grid = np.asarray(devices[:size], dtype=object).reshape(data, fsdp, tensor)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * 3)


def mesh_from_config(section: Any, *, devices: Sequence[Any] | None = None) -> Mesh:
    """``make_mesh`` from a config section with fields ``data``, ``fsdp``, ``tensor``."""
    return make_mesh(getattr(section, "data", -1), getattr(section, "fsdp", 1),
                     getattr(section, "tensor", 1), devices=devices)


def _rule_table(rules: Rules) -> dict[str, MeshAxes]:
    table: dict[str, MeshAxes] = {}
    for name, axes in rules:
        for ax in (axes,) if isinstance(axes, str) else (axes or ()):
            if ax not in MESH_AXES:
                raise ValueError(f"sharding rule {name!r} -> {axes!r}: unknown mesh axis {ax!r}; "
                                 f"expected one of {MESH_AXES}")
        table.setdefault(name, axes)  # first rule wins, as in flax's logical rules
    return table


def logical_to_spec(names: Sequence[str | None] | None, rules: Rules = DEFAULT_RULES, *,
                    where: str = "array") -> P:
    """Maps a tuple of logical axis names to a ``PartitionSpec`` by ``rules``.

    ``None`` entries stay replicated. Raises if a name has no rule or if two dimensions would be
    sharded over the same mesh axis.
    """
    if not names:
        return P()
    table = _rule_table(rules)
    out, used = [], set()
    for name in names:
        if name is None:
            out.append(None)
            continue
        if name not in table:
            raise ValueError(f"{where}: logical axis {name!r} has no sharding rule; "
                             f"known: {sorted(table)}")
        axes = table[name]
        flat = (axes,) if isinstance(axes, str) else tuple(axes or ())
        if used & set(flat):
            raise ValueError(f"{where}: logical axes {tuple(names)} map mesh axis "
                             f"{sorted(used & set(flat))} to two dimensions")
        used |= set(flat)
        out.append(axes if not isinstance(axes, list) else tuple(axes))
    return P(*out)


def _is_var(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def logical_axes(state: Any) -> dict:
    """Pure-dict tree of each param's logical axis names (``None`` when it has none)."""
    def names(v):
        meta = v.get_metadata() if _is_var(v) else {}
        return meta.get("out_sharding") or meta.get("sharding_names")
    flat = [(path, names(v)) for path, v in nnx.to_flat_state(state)]
    return traversals.unflatten_mapping(dict(flat))


def _path_str(path: tuple) -> str:
    return "/".join(str(k) for k in path)


def param_specs(state: Any, rules: Rules = DEFAULT_RULES, *, mesh: Mesh | None = None) -> dict:
    """Pure-dict tree of ``PartitionSpec`` for an ``nnx.State`` of params (abstract or real).

    With ``mesh``, also checks that every sharded dimension divides by its mesh-axis size and
    names the param, dimension and sizes when it does not.
    """
    flat = {}
    for path, v in nnx.to_flat_state(state):
        meta = v.get_metadata() if _is_var(v) else {}
        names = meta.get("out_sharding") or meta.get("sharding_names")
        value = v.get_value() if _is_var(v) else v
        where = f"param {_path_str(path)}"
        if names is not None and len(names) != len(value.shape):
            raise ValueError(f"{where}: {len(names)} logical axes {tuple(names)} for a "
                             f"rank-{len(value.shape)} array of shape {value.shape}")
        spec = logical_to_spec(names, rules, where=where)
        if mesh is not None:
            _check_divisible(spec, value.shape, mesh, where)
        flat[path] = spec
    return traversals.unflatten_mapping(flat)


def _check_divisible(spec: P, shape: Sequence[int], mesh: Mesh, where: str) -> None:
    for dim, axes in enumerate(spec):
        flat = (axes,) if isinstance(axes, str) else tuple(axes or ())
        size = math.prod(mesh.shape[a] for a in flat)
        if shape[dim] % size:
            raise ValueError(f"{where}: dimension {dim} of shape {tuple(shape)} is sharded over "
                             f"mesh axes {flat} of total size {size}, which does not divide it; "
                             f"shrink that mesh axis or map the logical axis to None in the rules")


def named(mesh: Mesh, specs: Any) -> Any:
    """Tree of ``PartitionSpec`` -> tree of ``NamedSharding`` on ``mesh``."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                        is_leaf=lambda x: isinstance(x, P))


def param_shardings(state: Any, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> dict:
    """Pure-dict tree of ``NamedSharding`` for an ``nnx.State`` of params."""
    return named(mesh, param_specs(state, rules, mesh=mesh))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_spec(ndim: int, rules: Rules = DEFAULT_RULES) -> P:
    """Activation spec: leading dim over the ``"batch"`` rule, the rest replicated."""
    if ndim == 0:
        return P()
    return P(_rule_table(rules).get("batch", BATCH_AXES), *([None] * (ndim - 1)))


def batch_sharding(mesh: Mesh, ndim: int = 2, rules: Rules = DEFAULT_RULES) -> NamedSharding:
    return NamedSharding(mesh, batch_spec(ndim, rules))


def batch_shardings(batch: Mapping | Any, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> Any:
    """Sharding tree for a batch: leading dim split over the batch axes, scalars replicated."""
    return jax.tree.map(lambda x: batch_sharding(mesh, np.ndim(x), rules), batch)


def batch_axes(rules: Rules = DEFAULT_RULES) -> tuple[str, ...]:
    """The mesh axes the leading batch dimension is split over (the ``"batch"`` rule)."""
    axes = _rule_table(rules).get("batch", BATCH_AXES)
    return (axes,) if isinstance(axes, str) else tuple(axes or ())


def batch_divisor(mesh: Mesh, rules: Rules = DEFAULT_RULES) -> int:
    """How many ways the leading batch dimension is split."""
    return math.prod(mesh.shape[a] for a in batch_axes(rules))


def shard_batch(batch: Any, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> Any:
    """``device_put`` a host batch with ``batch_shardings``; checks the leading dims divide."""
    div = batch_divisor(mesh, rules)

    def put(path, x):
        x = np.asarray(x) if not isinstance(x, jax.Array) else x
        if x.ndim and x.shape[0] % div:
            raise ValueError(f"batch{jax.tree_util.keystr(path)}: leading dim {x.shape[0]} is "
                             f"not divisible by the {div} batch shards of mesh {dict(mesh.shape)}")
        return jax.device_put(x, batch_sharding(mesh, x.ndim, rules))
    return jax.tree_util.tree_map_with_path(put, batch)


def without_axes(spec: P, axes: Sequence[str] = BATCH_AXES, *, drop_leading: int = 0) -> P:
    """``spec`` with the mesh ``axes`` removed from every dimension (those dimensions become
    replicated over them) and its first ``drop_leading`` dimensions dropped.

    FSDP gathers a weight just before use: a param sharded ``P("fsdp", "tensor")`` is used as
    ``P(None, "tensor")``; ``drop_leading=1`` gives one layer's slice of a stacked ``[L, ...]`` param.
    """
    def keep(entry):
        flat = (entry,) if isinstance(entry, str) else tuple(entry or ())
        rest = tuple(a for a in flat if a not in axes)
        return None if not rest else rest[0] if len(rest) == 1 else rest
    return P(*(keep(e) for e in tuple(spec)[drop_leading:]))
