"""The learner's train state: an explicit pytree ``(params, opt_state, step)`` on a device mesh.

``params`` is the pure nested-dict form of the model's ``nnx.Param`` state (the same
``params_tree`` layout ``models/hf.py`` reads and writes); the model's static structure lives in a
``ShardedModel`` next to it, which rebuilds the module inside a jitted function with ``bind``.
Every sharding comes from the params' logical axis names through ``sharding.py``'s rules; the
optimizer state's shardings are derived from the param shardings (under Auto axes ``opt.init``
would otherwise return single-device state, environment.md pitfall 2).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.nnx import traversals
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from laminar_jax import sharding as shd
from laminar_jax.models.decoder import TrainShardings


class TrainState(NamedTuple):
    params: Any           # pure dict of arrays
    opt_state: Any        # optax state
    step: jax.Array       # int32 scalar: optimizer updates applied so far


@dataclasses.dataclass(frozen=True, eq=False)
class ShardedModel:
    """A model's static graph plus where each of its params lives on ``mesh``."""
    graphdef: Any
    mesh: Mesh
    rules: tuple
    abstract_params: Any   # pure dict of ShapeDtypeStruct carrying the target sharding
    logical_axes: Any      # pure dict of logical-axis-name tuples
    param_shardings: Any   # pure dict of NamedSharding

    def bind(self, params: Any) -> nnx.Module:
        """Module with ``params`` (pure dict) plugged in; call inside jit, costs nothing at run time."""
        return nnx.merge(self.graphdef, params)

    def train_shardings(self):
        """`models.decoder.TrainShardings` for this mesh (FSDP: activations split over the
        batch axes, each layer's weights gathered over them inside the layer loop)."""
        specs = jax.tree.map(lambda s: s.spec, self.param_shardings,
                             is_leaf=lambda x: isinstance(x, NamedSharding))
        named = lambda spec: NamedSharding(self.mesh, spec)  # noqa: E731
        axes = shd.batch_axes(self.rules)
        layers = {k: named(shd.without_axes(v, axes, drop_leading=1)) for k, v in specs["layers"].items()}
        if "lm_head" in specs:
            head = shd.without_axes(specs["lm_head"], axes)
        else:  # tied: the transposed embedding
            head = P(*reversed(tuple(shd.without_axes(specs["embedding"], axes))))
        return TrainShardings(activations=shd.batch_sharding(self.mesh, 3, self.rules),
                              layer_params=layers, lm_head=named(head))

    def num_params(self) -> int:
        return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(self.abstract_params))


def _no_eager(init_fn: Callable[[], nnx.Module]) -> Callable[[], nnx.Module]:
    # flax 0.12 shards annotated Variables eagerly at creation, which needs a mesh context and
    # would place them by the raw logical names; the shardings here come from the rules instead.
    def f():
        with nnx.use_eager_sharding(False):
            return init_fn()
    return f


def _split_params(model: nnx.Module):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    extra = [("/".join(map(str, p)), type(v).__name__) for p, v in nnx.to_flat_state(rest)]
    if extra:
        raise ValueError(f"model has non-Param state the learner cannot train or shard: {extra}")
    return graphdef, params


def shard_model(init_fn: Callable[[], nnx.Module], mesh: Mesh,
                rules: shd.Rules = shd.DEFAULT_RULES) -> ShardedModel:
    """Traces ``init_fn`` abstractly (no memory) and derives every param's sharding by ``rules``."""
    abstract = nnx.eval_shape(_no_eager(init_fn))
    graphdef, state = _split_params(abstract)
    shardings = shd.param_shardings(state, mesh, rules)
    pure = nnx.to_pure_dict(state)
    abstract_params = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), pure, shardings)
    return ShardedModel(graphdef, mesh, tuple(rules), abstract_params, shd.logical_axes(state),
                        shardings)


def init_params(sharded: ShardedModel, init_fn: Callable[[], nnx.Module]) -> Any:
    """Runs ``init_fn`` under jit so every param is created directly in its shards."""
    def init():
        return nnx.to_pure_dict(_split_params(_no_eager(init_fn)())[1])
    return jax.jit(init, out_shardings=sharded.param_shardings)()


def _match_tree(expected: Any, tree: Any, what: str) -> Any:
    """``tree`` re-keyed onto ``expected``'s structure (``"0"`` keys from checkpoints -> ``0``)."""
    want = traversals.flatten_mapping(expected)
    by_str = {tuple(map(str, k)): k for k in want}
    got = {}
    for k, v in traversals.flatten_mapping(tree).items():
        key = by_str.get(tuple(map(str, k)))
        if key is None:
            raise ValueError(f"{what}: unexpected param {'/'.join(map(str, k))}")
        if tuple(np.shape(v)) != tuple(want[key].shape):
            raise ValueError(f"{what}: param {'/'.join(map(str, k))} has shape {np.shape(v)}, "
                             f"the model expects {tuple(want[key].shape)}")
        got[key] = v
    missing = sorted("/".join(map(str, k)) for k in want.keys() - got.keys())
    if missing:
        raise ValueError(f"{what}: missing params {missing}")
    return traversals.unflatten_mapping(got)


def place_params(sharded: ShardedModel, params_tree: Any, *, what: str = "params") -> Any:
    """Puts a host (numpy) or device params tree onto the mesh in the model's param dtypes."""
    tree = _match_tree(sharded.abstract_params, params_tree, what)
    return jax.tree.map(lambda x, a: jax.device_put(np.asarray(x).astype(a.dtype), a.sharding)
                        if not isinstance(x, jax.Array)
                        else jax.device_put(x.astype(a.dtype), a.sharding),
                        tree, sharded.abstract_params)


def opt_state_shardings(tx: optax.GradientTransformation, sharded: ShardedModel) -> Any:
    """Sharding tree for ``tx.init(params)``: every param-shaped leaf (moments etc.) gets the
    sharding of the param whose tree path it ends with; counters and the like are replicated.

    Matching by path suffix works for any optax chain, including masked transforms whose mask
    is a callable (which ``optax.tree_map_params`` cannot trace with its placeholder).
    """
    abstract_opt = jax.eval_shape(tx.init, sharded.abstract_params)
    by_path = {path: a for path, a in
               jax.tree_util.tree_flatten_with_path(sharded.abstract_params)[0]}
    rep = shd.replicated(sharded.mesh)

    def pick(path, leaf):
        for i in range(len(path)):
            a = by_path.get(tuple(path[i:]))
            if a is not None and tuple(a.shape) == tuple(leaf.shape):
                return a.sharding
        return rep
    return jax.tree_util.tree_map_with_path(pick, abstract_opt)


def train_state_shardings(tx: optax.GradientTransformation, sharded: ShardedModel) -> TrainState:
    return TrainState(sharded.param_shardings, opt_state_shardings(tx, sharded),
                      shd.replicated(sharded.mesh))


def init_train_state(sharded: ShardedModel, params: Any,
                     tx: optax.GradientTransformation) -> tuple[TrainState, TrainState]:
    """Fresh optimizer state for ``params`` (already placed). Returns ``(state, shardings)``."""
    shardings = train_state_shardings(tx, sharded)
    opt_state = jax.jit(tx.init, in_shardings=(sharded.param_shardings,),
                        out_shardings=shardings.opt_state)(params)
    step = jax.device_put(jnp.zeros((), jnp.int32), shardings.step)
    return TrainState(params, opt_state, step), shardings


def state_specs(shardings: TrainState) -> Any:
    """``PartitionSpec`` tree of a sharding tree (for logging and tests)."""
    return jax.tree.map(lambda s: s.spec, shardings, is_leaf=lambda x: isinstance(x, NamedSharding))


def abstract_train_state(sharded: ShardedModel, tx: optax.GradientTransformation) -> TrainState:
    """``TrainState`` of ``jax.ShapeDtypeStruct`` carrying the target shardings: the restore
    target orbax needs to load a checkpoint onto this mesh (any topology it was saved from)."""
    shardings = train_state_shardings(tx, sharded)
    shapes = TrainState(sharded.abstract_params, jax.eval_shape(tx.init, sharded.abstract_params),
                        jax.ShapeDtypeStruct((), jnp.int32))
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        shapes, shardings)
