"""One jitted, sharded optimizer update for any ``loss_fn(params, batch) -> (loss, metrics)``.

Gradient accumulation over ``num_micro_batches`` M:

    loss = sum_m loss_fn(params, batch_m),      grads = sum_m d loss_fn(params, batch_m) / d params

a plain sum, so a loss that divides by a *global* normaliser (e.g. the response-token count of the
whole mini-batch, passed in the batch as a scalar) gives exactly the big-batch loss and gradient,
whatever M is. With ``loss_accumulates`` the loss takes the running sum as a third argument,
``loss_fn(params, batch, grad_acc)``, and its gradient is ``grad_acc + d loss / d params``
(``models.decoder.add_to_grad``, ``scan_layers_into``): the decoder's backward layer loop then
adds each layer's gradient into the sum in place, instead of building the micro-batch's whole
fp32 gradient next to it (one fp32 gradient copy per device instead of two). Batch leaves of rank >= 1 are split along their leading axis (micro-batch m takes
rows m, m+M, m+2M, ..., which keeps every micro-batch spread over all batch shards without moving
data); rank-0 leaves (normalisers, coefficients) go to every micro-batch unchanged.

The update is skipped inside the step when the loss or the gradient norm is not finite (params,
optimizer state and step stay as they were), and the host wrapper then raises
``NonFiniteLossError`` naming the step, so a bad batch never silently turns the run into NaNs.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from laminar_jax import sharding as shd
from laminar_jax.learner import optim
from laminar_jax.learner.train_state import TrainState

LossFn = Callable[[Any, Any], tuple[jax.Array, Mapping[str, jax.Array]]]


class NonFiniteLossError(FloatingPointError):
    """The loss or gradient norm of a learner step was NaN/inf; the update was not applied.

    ``state`` holds the train state as it was before the step (still valid, e.g. to checkpoint).
    """

    def __init__(self, step: int, metrics: Mapping[str, Any], state: TrainState | None = None):
        self.step, self.metrics, self.state = step, dict(metrics), state
        shown = ", ".join(f"{k}={v}" for k, v in sorted(self.metrics.items()) if np.ndim(v) == 0)
        super().__init__(f"non-finite loss at learner step {step}: loss={self.metrics.get('loss')}, "
                         f"grad_norm={self.metrics.get('grad_norm')}; update skipped. "
                         f"Metrics: {shown}")


def split_micro_batches(batch: Any, num_micro_batches: int, mesh=None,
                        rules: shd.Rules = shd.DEFAULT_RULES) -> tuple[Any, Any]:
    """``(stacked, shared)``: rank >= 1 leaves as ``[M, B/M, ...]`` (strided rows), rank-0 leaves
    in ``shared`` (``None`` where a leaf was split)."""
    m = num_micro_batches

    def stack(path, x):
        if x.ndim == 0:
            return None
        if x.shape[0] % m:
            raise ValueError(f"batch{jax.tree_util.keystr(path)}: leading dim {x.shape[0]} is "
                             f"not divisible by num_micro_batches={m}")
        y = jnp.swapaxes(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 0, 1)
        if mesh is not None:
            spec = shd.batch_spec(x.ndim, rules)
            y = jax.lax.with_sharding_constraint(y, NamedSharding(mesh, P(None, *spec)))
        return y
    stacked = jax.tree_util.tree_map_with_path(stack, batch)
    shared = jax.tree.map(lambda x: x if x.ndim == 0 else None, batch)
    return stacked, shared


def _merge(stacked_slice: Any, shared: Any) -> Any:
    return jax.tree.map(lambda a, b: b if a is None else a, stacked_slice, shared,
                        is_leaf=lambda x: x is None)


def accumulate_gradients(loss_fn: LossFn, params: Any, batch: Any, *, num_micro_batches: int = 1,
                         param_shardings: Any = None, mesh=None,
                         rules: shd.Rules = shd.DEFAULT_RULES,
                         metric_reduction: str = "sum",
                         loss_accumulates: bool = False) -> tuple[jax.Array, Any, Any]:
    """``(loss, metrics, grads)`` summed over micro-batches (see the module docstring).

    ``metric_reduction="sum"`` sums metrics like the loss (exact for metrics normalised by the
    same global normaliser); ``"mean"`` averages them over micro-batches.
    """
    if metric_reduction not in ("sum", "mean"):
        raise ValueError(f"metric_reduction must be 'sum' or 'mean', got {metric_reduction!r}")
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    if num_micro_batches == 1:
        (loss, metrics), grads = grad_fn(params, batch)
        return loss, dict(metrics), grads

    stacked, shared = split_micro_batches(batch, num_micro_batches, mesh, rules)
    first = jax.tree.map(lambda x: None if x is None else x[0], stacked,
                         is_leaf=lambda x: x is None)
    _, metrics_shape = jax.eval_shape(loss_fn, params, _merge(first, shared))
    # accumulate in fp32 whatever the param dtype
    zeros_g = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    if param_shardings is not None:
        zeros_g = jax.lax.with_sharding_constraint(zeros_g, param_shardings)
    zeros_m = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), dict(metrics_shape))

    in_loss = loss_accumulates and all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))

    def body(carry, micro):
        g_acc, loss_acc, m_acc = carry
        if in_loss:  # the gradient comes back with g_acc already added (module docstring)
            (loss, metrics), g_acc = grad_fn(params, _merge(micro, shared), g_acc)
        else:
            (loss, metrics), grads = grad_fn(params, _merge(micro, shared))
            g_acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), g_acc, grads)
        m_acc = jax.tree.map(lambda a, v: a + v.astype(jnp.float32), m_acc, dict(metrics))
        return (g_acc, loss_acc + loss.astype(jnp.float32), m_acc), None

    (grads, loss, metrics), _ = jax.lax.scan(body, (zeros_g, jnp.zeros((), jnp.float32), zeros_m),
                                             stacked)
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
    if metric_reduction == "mean":
        metrics = jax.tree.map(lambda v: v / num_micro_batches, metrics)
    return loss, metrics, grads


def make_step_fn(loss_fn: LossFn, tx: optax.GradientTransformation, *,
                 schedule: optax.Schedule | None = None, num_micro_batches: int = 1,
                 param_shardings: Any = None, mesh=None, rules: shd.Rules = shd.DEFAULT_RULES,
                 metric_reduction: str = "sum",
                 loss_accumulates: bool = False) -> Callable[[TrainState, Any], tuple[TrainState, dict]]:
    """The un-jitted step ``(state, batch) -> (state, metrics)``."""

    def step_fn(state: TrainState, batch: Any):
        loss, metrics, grads = accumulate_gradients(
            loss_fn, state.params, batch, num_micro_batches=num_micro_batches,
            param_shardings=param_shardings, mesh=mesh, rules=rules,
            metric_reduction=metric_reduction, loss_accumulates=loss_accumulates)
        grad_norm = optax.global_norm(grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)  # noqa: E731
        new_state = TrainState(keep(params, state.params), keep(opt_state, state.opt_state),
                               state.step + ok.astype(state.step.dtype))
        out = dict(metrics)
        out.update(loss=loss, grad_norm=grad_norm, step=state.step, update_applied=ok)
        if schedule is not None:
            out["lr"] = jnp.asarray(optim.logged_lr(schedule, state.opt_state, state.step), jnp.float32)
        return new_state, out
    return step_fn


def signature(tree: Any) -> Any:
    """Hashable (structure, shapes, dtypes) of a pytree of arrays or ShapeDtypeStructs."""
    return (jax.tree.structure(tree),
            tuple((tuple(x.shape), str(np.dtype(x.dtype))) for x in jax.tree.leaves(tree)))


class AheadOfTime:
    """A jitted function plus executables compiled ahead of time for given input shapes.

    `precompile(*abstract_args)` lowers and compiles (e.g. on a background thread while the
    first rollouts generate); a call whose inputs have a precompiled signature runs that
    executable, waiting up to `wait_s` for one still compiling -- or only promised with
    `reserve(*abstract_args)`, so a call never compiles what the background thread is about to.
    A call of a promised signature whose compile has not begun compiles it itself, at the
    caller's priority (the background thread runs niced, and would reach it only after the
    shapes queued before it), and the background thread then skips it. `release()` drops
    promises whose compile never started (a failed thread). Any other call goes through the jit
    (which compiles a new signature once); `call_compiles` counts those.
    """

    def __init__(self, jitted: Any, wait_s: float = 600.0):
        self.jitted, self.wait_s = jitted, wait_s
        self._exe: dict[Any, Any] = {}
        self._pending: dict[Any, threading.Event] = {}
        self._started: set = set()
        self._jit_seen: set = set()
        self._lock = threading.Lock()

    @property
    def call_compiles(self) -> int:
        """Signatures compiled inside a call (not ahead of time)."""
        return len(self._jit_seen)

    def reserve(self, *args: Any) -> None:
        key = signature(args)
        with self._lock:
            if key not in self._exe:
                self._pending.setdefault(key, threading.Event())

    def release(self) -> None:
        with self._lock:
            for key in [k for k in self._pending if k not in self._started]:
                self._pending.pop(key).set()

    def precompile(self, *args: Any) -> None:
        key = signature(args)
        with self._lock:
            if key in self._exe or key in self._started:
                return
            self._started.add(key)
            done = self._pending.setdefault(key, threading.Event())
        try:
            self._exe[key] = self.jitted.lower(*args).compile()
        finally:
            done.set()

    def __call__(self, *args: Any) -> Any:
        key = signature(args)
        with self._lock:
            done = self._pending.get(key)
            claim = done is not None and key not in self._started and key not in self._exe
            if claim:
                self._started.add(key)
        if claim:   # promised but not begun: compiled here, not after the background's others
            try:
                self._exe[key] = self.jitted.lower(*args).compile()
            finally:
                done.set()
        elif done is not None and not done.wait(self.wait_s):
            raise TimeoutError(f"ahead-of-time compile of a learner step did not finish in {self.wait_s:.0f} s")
        exe = self._exe.get(key)
        if exe is not None:
            return exe(*args)
        self._jit_seen.add(key)
        return self.jitted(*args)


class TrainStep:
    """Jitted, sharded, donating train step with the host-side non-finite check.

    ``step(state, batch) -> (state, metrics)`` with ``metrics`` on the host (python floats for
    scalars). ``state`` is donated: do not use the passed-in state afterwards. One compilation per
    batch structure (tree, ranks, shapes, dtypes); later calls with the same shapes reuse it.
    """

    def __init__(self, loss_fn: LossFn, tx: optax.GradientTransformation,
                 state_shardings: TrainState, *, schedule: optax.Schedule | None = None,
                 num_micro_batches: int = 1, rules: shd.Rules = shd.DEFAULT_RULES,
                 metric_reduction: str = "sum", donate: bool = True, check_finite: bool = True,
                 loss_accumulates: bool = False):
        if num_micro_batches < 1:
            raise ValueError(f"num_micro_batches must be >= 1, got {num_micro_batches}")
        self.state_shardings = state_shardings
        self.mesh = jax.tree.leaves(state_shardings.params)[0].mesh
        self.rules = rules
        self.check_finite = check_finite
        self.loss_accumulates = loss_accumulates   # loss_fn(params, batch, grad_acc): module docstring
        self._step_fn = make_step_fn(loss_fn, tx, schedule=schedule,
                                     num_micro_batches=num_micro_batches,
                                     param_shardings=state_shardings.params, mesh=self.mesh,
                                     rules=rules, metric_reduction=metric_reduction,
                                     loss_accumulates=loss_accumulates)
        self._donate = (0,) if donate else ()
        self._jitted: dict[Any, Any] = {}

    def jitted(self, batch: Any):
        """The ``jax.jit`` object used for batches shaped like ``batch`` (for ``.lower``)."""
        return self._aot(batch).jitted

    def _aot(self, batch: Any) -> AheadOfTime:
        key = (jax.tree.structure(batch), tuple(np.ndim(x) for x in jax.tree.leaves(batch)))
        fn = self._jitted.get(key)
        if fn is None:
            batch_sh = shd.batch_shardings(batch, self.mesh, self.rules)
            fn = AheadOfTime(jax.jit(self._step_fn, in_shardings=(self.state_shardings, batch_sh),
                                     out_shardings=(self.state_shardings, shd.replicated(self.mesh)),
                                     donate_argnums=self._donate))
            self._jitted[key] = fn
        return fn

    def precompile(self, state: Any, batch: Any) -> None:
        """Compile the step for batches shaped like ``batch`` (arrays or ShapeDtypeStructs)
        now, so the first real step of that shape does not compile."""
        self._aot(batch).precompile(state, batch)

    def reserve(self, state: Any, batch: Any) -> None:
        """Promise a `precompile` of this shape: a step of it waits for that compile."""
        self._aot(batch).reserve(state, batch)

    def release(self) -> None:
        for aot in self._jitted.values():
            aot.release()

    @property
    def call_compiles(self) -> int:
        """Step shapes compiled inside a call rather than ahead of time (a compile counter)."""
        return sum(aot.call_compiles for aot in self._jitted.values())

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
        new_state, metrics = self._aot(batch)(state, batch)
        host = {k: (v.item() if np.ndim(v) == 0 else v) for k, v in jax.device_get(metrics).items()}
        if self.check_finite and not host["update_applied"]:
            raise NonFiniteLossError(int(host["step"]), host, new_state)
        return new_state, host
