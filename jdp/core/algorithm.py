"""The per-device step: grad -> reduce -> accumulate -> update, as pure functions of the state.

`device_step` runs on one device's b examples inside a layout (`jdp.core.layouts`): `jax.shard_map` or
`jax.pmap` over one mesh axis (`layout.axis`, "data" unless `axis_name=` says otherwise). It never asks which one: the layout hands it a `per_device` view of
the params and of the accumulator. Scales, with N devices, b examples per device and call, M calls
per optimizer step (accum_steps):

- every device computes the mean loss over its b examples and its gradient;
- the reduction gives the gradient of the mean loss over all N·b examples ("mean"), or N× it ("sum");
- accumulation averages M of those: the gradient one device would get on all M·N·b examples, i.e.
  the sum of the D·M micro-batch gradients scaled by 1/(D·M).
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


class Update(NamedTuple):
    """What one call leaves behind besides the counters: equal on every device."""

    params: object
    opt_state: object
    model_state: object
    skipped: jax.Array  # bool: the update was skipped (skip_nonfinite)


class Step(NamedTuple):
    """What `device_step` needs besides the state and batch; fixed when the step is built."""

    loss: object  # (params, model_state, batch, key) -> (loss, (aux, model_state)): `call_loss` bound to loss_fn
    optimizer: optax.GradientTransformation  # consumes the reduced gradient (MultiSteps with "every", M > 1)
    options: StepOptions
    layout: object  # a `jdp.core.layouts` layout: the per-device views of params and accumulator


def device_step(state: TrainState, batch, step: Step) -> tuple[TrainState, dict]:
    """One call on this device's b examples; returns the new state and metrics equal on every device."""
    o, layout = step.options, step.layout
    updates_now = (state.micro_step + 1) % o.accum_steps == 0
    key = device_key(state.rng, state.micro_step, layout.axis)

    # 1. grad: the mean loss over this device's b examples, and its gradient.
    (loss, (aux, model_state)), grads = jax.value_and_grad(step.loss, has_aux=True)(
        layout.per_device(state.params), state.model_state, batch, key)
    rows, masked = batch_rows(batch), has_mask(batch, o.mask_key)
    this_call = LocalAccum(grads, loss, aux, real_examples(batch, o.mask_key, rows))

    if o.local_accum:
        # 2. accumulate: this device's running sums, no communication. 3-4. On the M-th call only:
        #    reduce their mean once, update, and start the sums again. Model state (BatchNorm
        #    statistics) changes on every call: it is averaged now, a few small values, as "every" does.
        sums = jax.tree.map(jnp.add, layout.local(state.accum), this_call)
        mean = jax.tree.map(lambda x: x / o.accum_steps, sums)
        new, metrics = lax.cond(updates_now, lambda: reduce_and_update(state, mean, (), rows, masked, step),
                                lambda: hold(state, this_call, step))
        new = new._replace(model_state=mean_over_devices(model_state, layout.axis) if jax.tree.leaves(model_state) else model_state)
        accum = layout.shared(jax.tree.map(lambda s: jnp.where(updates_now, jnp.zeros_like(s), s), sums))
    else:
        # 2-4. reduce every call, then update: optax.MultiSteps (M > 1) keeps the running mean of
        #    the M reduced gradients and applies it on the M-th call.
        new, metrics = reduce_and_update(state, this_call, model_state, rows, masked, step)
        accum, metrics = mean_over_calls(state, metrics, updates_now, step)

    skip = new.skipped
    streak = jnp.where(skip, state.skip_streak + 1, jnp.where(updates_now, 0, state.skip_streak))
    state = state.replace(step=state.step + updates_now.astype(jnp.int32), micro_step=state.micro_step + 1,
                          params=new.params, opt_state=new.opt_state, model_state=new.model_state,
                          accum=accum, skipped=state.skipped + skip.astype(jnp.int32), skip_streak=streak)
    metrics.update(updated=updates_now & ~skip, skipped=skip, skip_streak=streak, step=state.step,
                   micro_step=state.micro_step)
    return state, metrics


def reduce_and_update(state: TrainState, local: LocalAccum, model_state, rows: int, masked: bool, step: Step):
    """Reduce this device's means over N devices, then take the optimizer step.

    `local` holds this device's mean gradient, loss and aux over its examples (over M calls with
    accum_sync="last") and its count of real examples (the same mean). The layout reduces them
    (one all-reduce; or, with the optimizer state sharded, a reduce-scatter of the gradient that
    leaves this device its slice, and a small all-reduce), and `own`/`gather` give the optimizer the
    params it updates here (all of them, or this device's slice) and every device the whole result.
    Returns the new params, optimizer and model state, whether the update was skipped, and the
    global metrics.
    """
    o, layout = step.options, step.layout
    grads, (loss, aux, model_state, examples) = layout.reduce(
        local.grads, (local.loss, local.aux, model_state, local.examples), o)
    if masked:  # means over the real examples, not the slots (without a mask the factor is 1: skip it)
        grads, loss, aux = over_real_examples((grads, loss, aux), examples, rows)
    params = layout.own(state.params)
    updates, opt_state = step.optimizer.update(grads, state.opt_state, params)
    new_params = optax.apply_updates(params, updates)
    step_grads = grads_of_step(grads, state.opt_state, o)
    skip = jnp.zeros((), bool)
    if o.skip_nonfinite:
        new_params, opt_state, skip = unless_nonfinite(step_grads, params, state.opt_state, new_params, opt_state,
                                                       o, layout)
    return (Update(layout.gather(new_params), opt_state, model_state, skip),
            step_metrics(loss, step_grads, aux, o, layout.global_norm))


def hold(state: TrainState, this_call: LocalAccum, step: Step):
    """accum_sync="last" between updates: state unchanged; no communication, so NaN metrics."""
    shapes = jax.eval_shape(lambda: step_metrics(this_call.loss, this_call.grads, this_call.aux, step.options,
                                                 step.layout.global_norm))
    return Update(state.params, state.opt_state, (), jnp.zeros((), bool)), nan_like(shapes)


def mean_over_calls(state: TrainState, metrics: dict, updates_now, step: Step):
    """accum_sync="every", M > 1: report loss and aux as means over the optimizer step's M calls
    (what "last" reports), NaN on the calls in between. Returns (new accumulator, metrics)."""
    o = step.options
    if not o.multi_steps:
        return state.accum, metrics
    sums = jax.tree.map(jnp.add, state.accum, LocalAccum(None, metrics["loss"], metrics.get("aux", {}), None))
    means = {"loss": sums.loss / o.accum_steps, "aux": jax.tree.map(lambda x: x / o.accum_steps, sums.aux)}
    # grad_norm is already the step's (grads_of_step); like the means, it is shown on the M-th call.
    shown = {k: means.get(k, v) for k, v in metrics.items() if k in ("loss", "aux", "grad_norm")}
    metrics = metrics | jax.tree.map(lambda x, nan: jnp.where(updates_now, x, nan), shown, nan_like(shown))
    return jax.tree.map(lambda s: jnp.where(updates_now, jnp.zeros_like(s), s), sums), metrics


def grads_of_step(grads, opt_state, o: StepOptions):
    """The gradient the optimizer step applies: this call's, or with MultiSteps the running mean
    of the step's calls so far (the mean of all M on the M-th call), as MultiSteps computes it."""
    if not o.multi_steps or not (o.skip_nonfinite or o.grad_norm):
        return grads
    n = opt_state.mini_step + 1
    return jax.tree.map(lambda g, acc: acc + (g - acc) / n, grads, opt_state.acc_grads)


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


def step_metrics(loss, grads, aux, o: StepOptions, global_norm) -> dict:
    """Global metrics from reduced values: means over all the examples the gradient covers.
    `global_norm(grads)` is the L2 norm of the whole gradient (from slices, if it is sharded)."""
    metrics = {"loss": loss.astype(jnp.float32)}
    if o.grad_norm:  # a pass over the reduced gradient: ~9% of an MLP step on 2 CPU devices
        metrics["grad_norm"] = global_norm(grads)
    if o.has_aux:
        metrics["aux"] = aux
    return metrics


def nan_like(tree):
    return jax.tree.map(lambda x: jnp.full(x.shape, jnp.nan, jnp.float32), tree)


def over_real_examples(values, mean_examples, rows: int):
    """Rescale means over all slots to means over the real (unmasked) examples.

    A masked loss is `sum(mask · l) / b` per device, so the reduced mean is Σ(mask · l) / (N·b);
    multiplying by b / mean(real count per device) = N·b / R gives Σ(mask · l) / R.
    """
    scale = jnp.float32(rows) / mean_examples
    return jax.tree.map(lambda x: (x * scale).astype(x.dtype), values)


def has_mask(batch, mask_key: str | None) -> bool:
    """Whether `batch` marks real and padded examples (static under tracing)."""
    return isinstance(batch, dict) and bool(mask_key) and mask_key in batch


def real_examples(batch, mask_key: str | None, rows: int) -> jax.Array:
    """This device's count of real examples: the mask's sum, or all `rows` without a mask."""
    return jnp.sum(batch[mask_key], dtype=jnp.float32) if has_mask(batch, mask_key) else jnp.float32(rows)


def batch_rows(batch) -> int:
    """The leading axis shared by every leaf of `batch` (static); one clear error otherwise."""
    leaves = jax.tree.leaves(batch)
    if not leaves:
        raise ValueError("batch has no array leaves; pass a pytree of arrays with a leading batch axis.")
    sizes = {jnp.shape(x)[0] if jnp.ndim(x) else None for x in leaves}
    if None in sizes:
        raise ValueError("every batch leaf needs a leading batch axis; found a scalar.")
    if len(sizes) != 1:
        raise ValueError(f"batch leaves disagree on the global batch size: {sorted(sizes)}.")
    return sizes.pop()


def unbound_axes(error: BaseException, bound: str) -> list[str]:
    """The axis names other than `bound` that the collectives on `error`'s traceback were called with.

    jax reports a collective over an axis that is not bound with a bare AssertionError (shard_map)
    or a NameError (pmap) from inside `jax.lax`; the axis it was asked for is in those frames.
    """
    found, tb = [], error.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_filename.replace("\\", "/").endswith("jax/_src/lax/parallel.py"):
            for name in ("axis_name", "axes"):
                value = frame.f_locals.get(name)
                for axis in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(axis, str) and axis != bound and axis not in found:
                        found.append(axis)
        tb = tb.tb_next
    return found


def call_loss(loss_fn, o: StepOptions, params, model_state, batch, key):
    """Call loss_fn as declared; always returns (loss, (aux, new_model_state))."""
    try:
        out = loss_fn(params, *((model_state,) if o.has_state else ()), batch, *((key,) if o.needs_rng else ()))
    except (AssertionError, NameError) as e:  # what jax raises for a collective over an axis it does not bind
        unbound = unbound_axes(e, o.axis_name)
        if not unbound:
            raise
        raise ValueError(f"loss_fn reduces over the mesh axis {unbound[0]!r} (a BatchNorm axis_name or a "
                         f"lax.pmean/psum inside it), but the step binds {o.axis_name!r}: pass "
                         f"axis_name={unbound[0]!r} to make_train_step, or name {o.axis_name!r} in the model.") from None
    if not (o.has_aux or o.has_state):
        return out, ({}, model_state)
    wanted = ("(loss, (aux, new_model_state))" if o.has_aux and o.has_state
              else "(loss, aux)" if o.has_aux else "(loss, new_model_state)")
    if not (isinstance(out, tuple) and len(out) == 2):
        raise ValueError(f"loss_fn must return {wanted}, got {type(out).__name__}.")
    loss, extras = out
    if o.has_aux and o.has_state and not (isinstance(extras, tuple) and len(extras) == 2):
        raise ValueError(f"loss_fn must return {wanted}.")
    aux, model_state = extras if o.has_aux and o.has_state else (extras, model_state) if o.has_aux else ({}, extras)
    for path, leaf in jax.tree_util.tree_leaves_with_path(aux):
        if jnp.ndim(leaf):  # averaged over devices, a per-example value would come back as garbage
            raise ValueError(f"aux{jax.tree_util.keystr(path)} has shape {jnp.shape(leaf)}; aux must hold scalars "
                             f"that are means over the examples (such as accuracy), which jdp averages over "
                             f"devices: return per-example values such as logits from a separate function.")
    return loss, (aux, model_state)
