"""The one-device reference of `assert_data_parallel_exact` for weighted losses, and the check that
names a loss which divides by a count of its own.

A loss that returns `jdp.Weighted(total, weight)` is a mean over all the weight of an optimizer
step: one device sums the totals, gradients and weights of the step's M micro-batches and divides
once (never `optax.MultiSteps`' mean of micro-batch means). A plain loss that divides by its own
examples' or tokens' count is not a mean over examples: its value on the whole batch differs from
the mean of its values on the device shards, which `own_count_hint` measures.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jdp.core.weighting import Weighted, is_weighted, ratios, weighted_aux


def _call(setup, params, model_state, batch):
    """(loss, aux, new_model_state) of the user's loss, as declared."""
    out = setup.loss_fn(params, model_state, batch) if setup.has_state else setup.loss_fn(params, batch)
    if setup.has_aux and setup.has_state:
        return out[0], out[1][0], out[1][1]
    if setup.has_aux:
        return out[0], out[1], model_state
    return (out[0], {}, out[1]) if setup.has_state else (out, {}, model_state)


def is_weighted_loss(setup, batch, axis: str) -> bool:
    """Whether the loss returns `jdp.Weighted` (traced once on `batch`, nothing computed)."""
    model_state = setup.model_state if setup.has_state else ()
    params = jax.tree.map(jnp.asarray, setup.start)
    traced = jax.vmap(lambda b: _call(setup, params, model_state, b)[0], axis_name=axis)
    out = jax.eval_shape(traced, jax.tree.map(lambda x: np.asarray(x)[None], batch))
    return is_weighted(out)


def reference_weighted(setup, batches, m: int, axis: str, device):
    """One device: per optimizer step, the sums of the M micro-batches' totals, gradients, aux and
    weights, divided once by the step's weight, then the optimizer update. Returns what
    `_reference_params` returns: (initial, final, losses, aux) per step."""

    def sums(params, model_state, batch):
        def total(p):
            loss, aux, new_state = _call(setup, p, model_state, batch)
            w = jnp.asarray(loss.weight, jnp.float32)
            return loss.total, (w, weighted_aux(aux, lambda a: Weighted(a * w, w)), new_state)

        (value, (w, aux, new_state)), grads = jax.value_and_grad(total, has_aux=True)(params)
        return grads, value, w, aux, new_state

    def update(params, opt_state, grads, weight):
        updates, opt_state = setup.tx.update(jax.tree.map(lambda g: g / weight, grads), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    one = lambda tree: jax.tree.map(lambda x: x[None], tree)  # noqa: E731
    first = lambda tree: jax.tree.map(lambda x: x[0], tree)  # noqa: E731
    step_sums = jax.jit(jax.vmap(sums, axis_name=axis))
    step_update = jax.jit(update)
    params = jax.device_put(setup.start, device)
    model_state = jax.device_put(setup.model_state if setup.has_state else (), device)
    opt_state = setup.tx.init(params)
    losses, auxes = [], []
    for batch in batches:
        acc = None
        for micro in _micro(batch, m):
            grads, value, w, aux, new_state = first(step_sums(one(params), one(model_state),
                                                              one(jax.device_put(micro, device))))
            model_state = new_state
            call = (grads, value, w, aux)
            acc = call if acc is None else jax.tree.map(jnp.add, acc, call)
        grads, value, w, aux = acc
        params, opt_state = step_update(params, opt_state, grads, w)
        losses.append(np.float32(value / w))
        auxes.append(jax.device_get(ratios(aux)))
    initial, final = {"params": jax.device_get(setup.start)}, {"params": jax.device_get(params)}
    if setup.has_state:
        initial["model_state"], final["model_state"] = jax.device_get(setup.model_state), jax.device_get(model_state)
    return initial, final, jax.device_get(losses), auxes


def _micro(batch, m: int) -> list:
    b = jax.tree.leaves(batch)[0].shape[0] // m
    return [jax.tree.map(lambda x: x[k * b:(k + 1) * b], batch) for k in range(m)]


def own_count_hint(setup, batch, devices: int, axis: str) -> str | None:
    """A sentence when a plain loss is not a mean over examples: on `batch` (one micro-batch) its
    value differs from the mean of its values on the `devices` shards, as when it divides by each
    shard's own count of tokens; None when it is a mean (or has model state, which shards change)."""
    if setup.has_state or not all(np.shape(x)[0] % devices == 0 for x in jax.tree.leaves(batch)):
        return None
    params = jax.tree.map(jnp.asarray, setup.start)
    value = jax.jit(jax.vmap(lambda b: _call(setup, params, (), b)[0], axis_name=axis))
    stacked = lambda tree, n: jax.tree.map(lambda x: np.asarray(x).reshape(n, -1, *np.shape(x)[1:]), tree)  # noqa: E731
    whole = float(value(stacked(batch, 1))[0])
    shards = [float(value(stacked(jax.tree.map(lambda x, d=d: np.asarray(x)[np.arange(len(x)) // (len(x) // devices)
                                                                         == d], batch), 1))[0])
              for d in range(devices)]
    mean = float(np.mean(shards))
    if abs(whole - mean) <= 1e-5 * max(1.0, abs(whole)):
        return None
    if abs(whole - devices * mean) <= 1e-4 * max(1.0, abs(whole)):
        return (f"loss_fn is not a mean over examples: on the first batch its value on the whole batch ({whole:.6g}) is "
                f"{devices} times the mean of its values on the {devices} device shards ({mean:.6g}), as a sum over "
                f"examples is; return the mean (jdp averages over devices), or jdp.Weighted(sum, count).")
    return (f"loss_fn is not a mean over examples: on the first batch its value on the whole batch ({whole:.6g}) "
            f"differs from the mean of its values on the {devices} device shards ({mean:.6g}), as when it divides by "
            f"each shard's own count of real tokens; return jdp.Weighted(sum of the losses, their count) so that jdp "
            f"divides by the global count once.")
