"""Gradient accumulation carried through the backward pass (``learner.train_step``'s
``loss_accumulates``): the cotangent of a param comes back as ``running sum + gradient``.

Accumulating over micro-batches as ``acc = acc + grad(loss_m)`` holds two fp32 copies of the
gradient at the end of every micro-batch's backward pass: the running sum and the micro-batch's
whole gradient. For the stacked decoder layers (almost every param) ``scan_layers_into`` adds
each layer's gradient into its slice of the running sum inside the backward layer loop, so the
second copy never exists; ``add_to_grad`` does the same for the other params (after their
backward, small). Pure functions of arrays; no config here.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.custom_vjp
def add_to_grad(tree, grad_acc):
    """``tree`` itself; its vjp w.r.t. ``tree`` is ``grad_acc + cotangent`` (a gradient
    accumulator carried through the backward pass; ``grad_acc`` gets no gradient)."""
    del grad_acc
    return tree


def _add_to_grad_fwd(tree, grad_acc):
    return tree, grad_acc


def _add_to_grad_bwd(grad_acc, ct):
    return jax.tree.map(lambda a, g: (a + g.astype(a.dtype)).astype(g.dtype), grad_acc, ct), None


add_to_grad.defvjp(_add_to_grad_fwd, _add_to_grad_bwd)


def scan_layers_into(body, x, layer_params, grad_acc):
    """``lax.scan(body, x, layer_params)``'s carry, with "block" remat, whose vjp w.r.t.
    ``layer_params`` is ``grad_acc + d/d layer_params``, summed into ``grad_acc`` layer by layer.

    ``body(x, p_l) -> (x, _)``. Gradient accumulation over micro-batches otherwise holds two
    fp32 copies of the layers' gradients: the running sum and the stacked ``[L, ...]``
    gradients of the micro-batch being added to it (2 x 15.3 GiB per device for Qwen2.5-32B at
    fsdp 8; ``experiments/memory_plan.py``'s buffer assignment). Here the backward layer loop
    carries the running sum itself and adds each layer's gradient into its slice
    (``dynamic_update_slice`` of a loop-carried buffer, in place), so only one copy exists.

    The forward pass saves each block's input (what ``jax.checkpoint`` of the block saves) and
    the backward recomputes the block (``jax.vjp``), so the maths is "block" remat's exactly.
    ``grad_acc`` must have ``layer_params``' dtypes (a cotangent has its primal's dtype).
    """
    num_layers = jax.tree.leaves(layer_params)[0].shape[0]

    def step(c, p):
        return body(c, p)[0]

    @jax.custom_vjp
    def run(x, params, acc):
        del acc
        return jax.lax.scan(lambda c, p: (step(c, p), None), x, params)[0]

    def fwd(x, params, acc):
        y, inputs = jax.lax.scan(lambda c, p: (step(c, p), c), x, params)
        return y, (inputs, params, acc)

    def bwd(res, ct):
        inputs, params, acc = res

        def back(carry, i):
            ct_x, acc = carry
            at = lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False)  # noqa: E731
            _, vjp = jax.vjp(step, at(inputs), jax.tree.map(at, params))
            ct_x, ct_p = vjp(ct_x)
            acc = jax.tree.map(lambda a, g: jax.lax.dynamic_update_index_in_dim(
                a, at(a) + g.astype(a.dtype), i, 0), acc, ct_p)
            return (ct_x, acc), None
        order = jnp.arange(num_layers - 1, -1, -1, dtype=jnp.int32)
        (ct_x, acc), _ = jax.lax.scan(back, (ct, acc), order)
        return ct_x, acc, None

    run.defvjp(fwd, bwd)
    return run(x, layer_params, grad_acc)


def decoder_params_into(params, grad_acc):
    """``(params, layer_grad_acc)`` for a loss over a ``models.decoder.Decoder`` params tree
    whose gradient must come back as ``grad_acc + gradient``: every top-level param but the
    stacked ``layers`` wrapped in ``add_to_grad``, and ``grad_acc["layers"]`` for
    ``Decoder.hidden(layer_grad_acc=...)``, which sums it inside its backward layer loop.
    ``grad_acc=None``: ``(params, None)`` unchanged."""
    if grad_acc is None:
        return params, None
    rest = {k: v for k, v in params.items() if k != "layers"}
    return {**add_to_grad(rest, {k: grad_acc[k] for k in rest}), "layers": params["layers"]}, grad_acc["layers"]
