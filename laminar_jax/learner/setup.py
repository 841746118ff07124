"""Builds a learner from the config: mesh, model (preset or Hugging Face folder), optimizer and
a fresh, sharded train state. Shared by `laminar sft` and the RL learner."""
from __future__ import annotations

from typing import Any, NamedTuple

import optax
from flax import nnx
from jax.sharding import Mesh

from laminar_jax import sharding as shd
from laminar_jax.learner import train_state as ts
from laminar_jax.learner.optim import optimizer_from_config
from laminar_jax.models.config import DecoderConfig
from laminar_jax.models.decoder import Decoder
from laminar_jax.rl.ewma import ewma_tracker


class LearnerSetup(NamedTuple):
    model_cfg: DecoderConfig
    mesh: Mesh
    sharded: ts.ShardedModel
    tx: optax.GradientTransformation
    schedule: optax.Schedule
    state: ts.TrainState
    shardings: ts.TrainState


def model_config(model_section: Any) -> tuple[DecoderConfig, Any]:
    """``(DecoderConfig, host params tree or None)`` from a ``model`` config section: the
    Hugging Face folder ``hf_path`` when set (weights loaded), else the named ``preset`` (with
    ``vocab_size`` when that is not 0)."""
    m = model_section
    if getattr(m, "hf_path", None):
        from laminar_jax.models.hf import load_pretrained
        dcfg, params = load_pretrained(m.hf_path, param_dtype=m.param_dtype, dtype=m.dtype)
        return dcfg.replace(attention=getattr(m, "attention", "auto")), params
    return DecoderConfig.from_model_section(m), None


def build(cfg: Any, *, total_steps: int, lr: float | None = None,
          rules: shd.Rules = shd.DEFAULT_RULES, remat: bool | str | None = None) -> LearnerSetup:
    """Mesh from ``cfg.mesh``, model from ``cfg.model`` (seeded by ``cfg.run.seed`` when not
    loaded), optimizer from ``cfg.optimizer`` over ``total_steps`` (``lr`` overrides its lr).
    ``remat`` defaults to ``cfg.learner.remat``; ``model.attention`` is checked against the
    backend here, before any step is traced."""
    from laminar_jax.models.attention import resolve
    dcfg, host_params = model_config(cfg.model)
    if getattr(getattr(cfg, "rollout", None), "zero_mismatch", False):  # the engines' exact decoder
        dcfg = dcfg.replace(attention="exact")
    resolve(dcfg.attention)
    if remat is None:
        remat = getattr(getattr(cfg, "learner", None), "remat", "none")
    import jax
    if jax.process_count() > 1:   # one learner over several hosts (learner/distributed.py)
        from laminar_jax.learner.distributed import global_mesh
        mesh = global_mesh(cfg.mesh)
    else:
        mesh = shd.mesh_from_config(cfg.mesh)
    seed = getattr(getattr(cfg, "run", None), "seed", 0)
    mlp_chunk = getattr(getattr(cfg, "learner", None), "mlp_chunk", 0)
    init_fn = lambda: Decoder(dcfg, rngs=nnx.Rngs(seed), remat=remat, mlp_chunk=mlp_chunk)  # noqa: E731
    sharded = ts.shard_model(init_fn, mesh, rules)
    params = (ts.init_params(sharded, init_fn) if host_params is None
              else ts.place_params(sharded, host_params, what=cfg.model.hf_path))
    tx, schedule = optimizer_from_config(cfg.optimizer, total_steps=total_steps, lr=lr)
    loss = getattr(cfg, "loss", None)
    if loss is not None and loss.needs_ewma:  # PPO-EWMA anchor: the average rides in opt_state
        tx = optax.chain(tx, ewma_tracker(loss.correction.ewma_decay))
    state, shardings = ts.init_train_state(sharded, params, tx)
    return LearnerSetup(dcfg, mesh, sharded, tx, schedule, state, shardings)
