"""The per-device step: grad -> reduce -> accumulate -> update, as pure functions of the state.

`device_step` runs on one device's b examples inside a layout (`jdp.core.layouts`): `jax.shard_map` or
`jax.pmap` over one mesh axis (`layout.axis`, "data" unless `axis_name=` says otherwise). It never asks which one: the layout hands it a `per_device` view of
the params and of the accumulator. Scales, with N devices, b examples per device and call, M calls
per optimizer step (accum_steps):

- every device computes its loss and gradient over its b examples: the mean loss, or a weighted
  one as a sum with its weight (`jdp.Weighted`, e.g. a sum over real tokens and their count);
- the reduction gives the gradient of the mean loss over all N·b examples ("mean"), or N× it ("sum");
- accumulation averages M of those: the gradient one device would get on all M·N·b examples, i.e.
  the sum of the D·M micro-batch gradients scaled by 1/(D·M).

A weighted loss is divided once, by the weight summed over the N devices and the M micro-batches of
the optimizer step: its gradient is that of Σ w·l / Σ w over the whole global batch, never a mean of
per-device or per-micro-batch means.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jdp.core.options import StepOptions
from jdp.core.reduce import mean_over_devices
from jdp.core.state import LocalAccum, TrainState, device_key
from jdp.core.weighting import divided, ratios


class Update(NamedTuple):
    """What one call leaves behind besides the counters: equal on every device."""

    params: object
    opt_state: object
    model_state: object
    skipped: jax.Array  # bool: the update was skipped (skip_nonfinite)


class Step(NamedTuple):
    """What `device_step` needs besides the state and batch; fixed when the step is built."""

    loss: object  # (params, model_state, batch, key) -> (total, (aux, model_state, weight)): `call_loss` bound
    optimizer: optax.GradientTransformation  # consumes the reduced gradient (MultiSteps with "every", M > 1)
    options: StepOptions
    layout: object  # a `jdp.core.layouts` layout: the per-device views of params and accumulator


def device_step(state: TrainState, batch, step: Step) -> tuple[TrainState, dict]:
    """One call on this device's b examples; returns the new state and metrics equal on every device."""
    o, layout = step.options, step.layout
    updates_now = (state.micro_step + 1) % o.accum_steps == 0
    key = device_key(state.rng, state.micro_step, layout.axis)

    # 1. grad: this device's loss over its b examples and its gradient. A weighted loss comes as its
    #    sum with the weight (`jdp.core.weighting`); a plain mean loss has no weight (None).
    (total, (aux, model_state, weight)), grads = jax.value_and_grad(step.loss, has_aux=True)(
        layout.per_device(state.params), state.model_state, batch, key)
    weighted = weight is not None  # static: the loss's form, seen when the step is traced
    this_call = LocalAccum(grads, total, aux, weight if weighted else jnp.ones((), jnp.float32))

    if o.local_accum:
        # 2. accumulate: this device's running sums, no communication. 3-4. On the M-th call only:
        #    reduce their mean once, update, and start the sums again. Model state (BatchNorm
        #    statistics) changes on every call: it is averaged now, a few small values, as "every" does.
        sums = jax.tree.map(jnp.add, layout.local(state.accum), this_call)
        mean = jax.tree.map(lambda x: x / o.accum_steps, sums)
        new, metrics = lax.cond(updates_now, lambda: update_now(state, mean, weighted, step),
                                lambda: hold(state, this_call, weighted, step))
        new = new._replace(model_state=mean_over_devices(model_state, layout.axis) if jax.tree.leaves(model_state) else model_state)
        accum = layout.shared(jax.tree.map(lambda s: jnp.where(updates_now, jnp.zeros_like(s), s), sums))
    else:
        # 2-4. reduce every call, then update: optax.MultiSteps (M > 1) keeps the running mean of
        #    the M reduced gradients and applies it on the M-th call (a weighted loss's divided by the
        #    step's whole weight, `weight_scale`).
        new, reduced, norm = reduce_and_update(state, this_call, model_state, weighted, step)
        accum, metrics = over_the_step(state, reduced, norm, updates_now, weighted, step)

    skip = new.skipped
    streak = jnp.where(skip, state.skip_streak + 1, jnp.where(updates_now, 0, state.skip_streak))
    state = state.replace(step=state.step + updates_now.astype(jnp.int32), micro_step=state.micro_step + 1,
                          params=new.params, opt_state=new.opt_state, model_state=new.model_state,
                          accum=accum, skipped=state.skipped + skip.astype(jnp.int32), skip_streak=streak)
    metrics.update(updated=updates_now & ~skip, skipped=skip, skip_streak=streak, step=state.step,
                   micro_step=state.micro_step)
    return state, metrics


def reduce_and_update(state: TrainState, local: LocalAccum, model_state, weighted: bool, step: Step):
    """Reduce this device's values over N devices, then take the optimizer step.

    `local` holds this device's loss and gradient (a mean, or with `weighted` a sum with its weight;
    over M calls with accum_sync="last", the mean of their sums) and aux. The layout reduces them
    (one all-reduce; or, with the optimizer state sharded, a reduce-scatter of the gradient that
    leaves this device its slice, and a small all-reduce), and `own`/`gather` give the optimizer the
    params it updates here (all of them, or this device's slice) and every device the whole result.
    A weighted gradient is divided by the reduced weight here, or with optax.MultiSteps by the whole
    step's weight inside it (`grad_scale`). Returns the new params, optimizer and model state and
    whether the update was skipped; the reduced values (means over devices of each device's loss,
    aux and weight); and the global norm of the step's gradient (None without grad_norm).
    """
    o, layout = step.options, step.layout
    grads, (total, aux, model_state, weight) = layout.reduce(
        local.grads, (local.loss, local.aux, model_state, local.weight), o)
    scale, extra = None, {}
    if weighted and o.multi_steps:
        scale = weight_scale(state, weight, o.accum_steps)
        extra = {"grad_scale": scale}
    elif weighted:  # the gradient of Σ w·l / Σ w: the reduced sums over the reduced weight, once
        grads = divided(grads, weight)
    params = layout.own(state.params)
    updates, opt_state = step.optimizer.update(grads, state.opt_state, params, **extra)
    new_params = optax.apply_updates(params, updates)
    step_grads = grads_of_step(grads, state.opt_state, o, scale)
    skip = jnp.zeros((), bool)
    if o.skip_nonfinite:
        new_params, opt_state, skip = unless_nonfinite(step_grads, params, state.opt_state, new_params, opt_state,
                                                       o, layout)
    norm = layout.global_norm(step_grads) if o.grad_norm else None  # ~9% of an MLP step on 2 CPU devices
    return (Update(layout.gather(new_params), opt_state, model_state, skip), LocalAccum(None, total, aux, weight),
            norm)


def weight_scale(state: TrainState, weight, accum_steps: int):
    """accum_sync="every", weighted loss: the factor that turns MultiSteps' running mean of the n
    reduced gradient sums so far into their sum over the step's weight so far: n / Σ_k weight_k
    (weights are means over devices, like the sums).

    Only the M-th call's factor reaches the params: n / the whole step's weight, which is 1/0 (NaN
    params) for a step of no weight at all. Before it, MultiSteps still runs the inner update and
    returns emit · update, so a 1/0 there (the step's first calls all padding) would be 0 · NaN: a
    call before the last whose weight so far is 0 divides by 1 instead (its sums are 0 too).
    """
    calls, so_far = state.opt_state.mini_step + 1, state.accum.weight + weight
    so_far = jnp.where((calls < accum_steps) & (so_far == 0), jnp.ones_like(so_far), so_far)
    return calls.astype(jnp.float32) / so_far


def update_now(state: TrainState, mean: LocalAccum, weighted: bool, step: Step):
    """accum_sync="last", the M-th call: reduce the mean of this device's M calls once and update."""
    o = step.options
    new, reduced, norm = reduce_and_update(state, mean, (), weighted, step)
    return new, step_metrics(reduced, norm, weighted, step.layout.weight_devices * o.accum_steps, 1, o)


def hold(state: TrainState, this_call: LocalAccum, weighted: bool, step: Step):
    """accum_sync="last" between updates: state unchanged; no communication, so NaN metrics."""
    o = step.options
    norm = jnp.zeros((), jnp.float32) if o.grad_norm else None
    shapes = jax.eval_shape(lambda: step_metrics(this_call._replace(grads=None), norm, weighted, 1, 1, o))
    return Update(state.params, state.opt_state, (), jnp.zeros((), bool)), nan_like(shapes)


def over_the_step(state: TrainState, reduced: LocalAccum, norm, updates_now, weighted: bool, step: Step):
    """The metrics of one call with accum_sync="every": this call's, or with M > 1 those of the
    optimizer step's M calls so far (their sums reduced, then divided: what "last" reports), shown
    on the M-th call and NaN on the calls in between. Returns (new accumulator, metrics)."""
    o, n = step.options, step.layout.weight_devices
    if not o.multi_steps:
        return state.accum, step_metrics(reduced, norm, weighted, n, 1, o)
    sums = jax.tree.map(jnp.add, state.accum, reduced)
    metrics = step_metrics(sums, norm, weighted, n, o.accum_steps, o)
    # grad_norm is already the step's (grads_of_step); like the means, it is shown on the M-th call.
    metrics = jax.tree.map(lambda x, nan: jnp.where(updates_now, x, nan), metrics, nan_like(metrics))
    return jax.tree.map(lambda s: jnp.where(updates_now, jnp.zeros_like(s), s), sums), metrics


def grads_of_step(grads, opt_state, o: StepOptions, scale=None):
    """The gradient the optimizer step applies: this call's, or with MultiSteps the running mean
    of the step's calls so far (the mean of all M on the M-th call), as MultiSteps computes it,
    times `scale` for a weighted loss (`weight_scale`)."""
    if not o.multi_steps or not (o.skip_nonfinite or o.grad_norm):
        return grads
    n = opt_state.mini_step + 1
    mean = jax.tree.map(lambda g, acc: acc + (g - acc) / n, grads, opt_state.acc_grads)
    return mean if scale is None else jax.tree.map(lambda g: (g * scale).astype(g.dtype), mean)


def unless_nonfinite(step_grads, old_params, old_opt_state, params, opt_state, o: StepOptions, layout):
    """skip_nonfinite: keep the old params and optimizer state if the step's reduced gradient, or
    the params or optimizer state it produced, hold a NaN/Inf. `layout.everywhere` makes it one
    decision on every device (with the optimizer state sharded, each device sees only its slice).
    Finite gradients can still make them non-finite, e.g. an Adam ε of 0 or a second moment that
    overflows."""
    # Padding (sharded layout) is not checked: a zero gradient there is not the step's.
    real_grads, real_params, real_state = layout.without_padding(step_grads, params, opt_state)
    # MultiSteps' running sum may hold a NaN until the update: its inner state is what counts.
    inner = real_state.inner_opt_state if o.multi_steps else real_state
    checked = [x for x in jax.tree.leaves((real_grads, real_params, inner)) if jnp.issubdtype(x.dtype, jnp.inexact)]
    finite = layout.everywhere(jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in checked])))
    keep = lambda new, old: jax.tree.map(lambda n, p: jnp.where(finite, n, p), new, old)  # noqa: E731
    if o.multi_steps:
        # MultiSteps resets its sum as (1 - emit)·sum, which keeps a NaN: reset it here. Between
        # updates the NaN stays in the running mean, so the M-th call sees it and skips.
        emit = opt_state.mini_step == 0
        acc = jax.tree.map(lambda a: jnp.where(emit, jnp.zeros_like(a), a), opt_state.acc_grads)
        opt_state = opt_state._replace(acc_grads=acc,
                                       inner_opt_state=keep(opt_state.inner_opt_state, old_opt_state.inner_opt_state))
        return keep(params, old_params), opt_state, emit & ~finite
    return keep(params, old_params), keep(opt_state, old_opt_state), ~finite


def step_metrics(sums: LocalAccum, norm, weighted: bool, weight_factor: int, calls: int, o: StepOptions) -> dict:
    """Global metrics from reduced values: means over all the examples (or weights) the gradient covers.

    `sums`: loss, aux and weight, each the mean over devices of a device's values, summed over
    `calls` calls. Weighted: loss = Σ total / Σ weight, aux the same per `jdp.Weighted` leaf, and
    `weight` the global weight (× `weight_factor`: devices, × M for "last"'s mean over calls).
    Plain means: divided by `calls`. `norm`: the step gradient's global L2 norm, or None.
    """
    if weighted:
        metrics = {"loss": (sums.loss / sums.weight).astype(jnp.float32), "weight": sums.weight * weight_factor}
        aux = ratios(sums.aux)
    else:
        metrics = {"loss": (sums.loss / calls if calls > 1 else sums.loss).astype(jnp.float32)}
        aux = jax.tree.map(lambda x: x / calls, sums.aux) if calls > 1 else sums.aux
    if norm is not None:
        metrics["grad_norm"] = norm
    if o.has_aux:
        metrics["aux"] = aux
    return metrics


def nan_like(tree):
    return jax.tree.map(lambda x: jnp.full(x.shape, jnp.nan, jnp.float32), tree)
