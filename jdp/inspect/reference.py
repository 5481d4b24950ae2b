"""The one-device runs `assert_data_parallel_exact` compares jdp with, written without jdp's step.

The reference is the definition: ONE device takes ONE step on the WHOLE global batch of each
optimizer step (its accum_steps micro-batches, and with an `optax.MultiSteps(inner, k)` optimizer
its k consecutive batches, concatenated), with the inner optimizer. Plain JAX:
`jax.jit(value_and_grad)` and the optax update (or Flax's `nnx.Optimizer` loop for an nnx model).

Micro-batches appear in the reference only where they are part of the model's definition: a model
with state (BatchNorm statistics, Linen's `batch_stats`, an nnx `BatchStat`) computes statistics
per micro-batch, so its reference steps `optax.MultiSteps(inner, M·k)` through the same
micro-batches. A loss that returns `jdp.Weighted(total, weight)` is a mean over all the weight of an
optimizer step: its reference sums the step's totals, gradients and weights and divides once, which
is the whole-batch step. A plain loss that divides by its own examples' or tokens' count is not a
mean over examples, so accumulating its micro-batch means is not the whole-batch step, and the
comparison fails, as it must (`jdp.inspect.exactness_hints.own_count_hint` names the cause).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jdp.core.weighting import Weighted, is_weighted, ratios, weighted_aux


def one_device_reference(setup, loss_fn, params_or_model, batches: list, accum_steps: int, has_aux: bool, axis: str,
                         device):
    """The one-device run every jdp run is compared with: per optimizer step, its whole global batch
    (`optimizer_batches`) in one step of the inner optimizer (`setup.tx`); with model state, its
    `accum_steps` · `setup.every_k` micro-batches through `optax.MultiSteps`, as the module docstring
    says. Returns (initial, final, losses per optimizer step, aux per optimizer step), the trees as
    {"params": ..., "model_state": ...} on the host."""
    whole, m = optimizer_batches(batches, setup.every_k), accum_steps * setup.every_k
    per_micro = has_model_state(setup, params_or_model) and m > 1
    tx = optax.MultiSteps(setup.tx, m).gradient_transformation() if per_micro else setup.tx
    m = m if per_micro else 1
    if isinstance(params_or_model, nnx.Module):
        loss = model_loss(setup)
        if is_weighted_model_loss(loss, params_or_model, batches[0]):
            return _reference_model(loss, setup.tx, params_or_model, whole, m, device, True)
        return _reference_model(loss, tx, params_or_model, whole, m, device)
    if is_weighted_loss(setup, batches[0], axis):
        return reference_weighted(setup, whole, m, axis, device)
    return _reference_params(setup, tx, whole, m, axis, device)


def optimizer_batches(batches: list, every_k: int) -> list:
    """The global batch of each optimizer step: `batches` in groups of `every_k` (an
    `optax.MultiSteps(inner, every_k)` optimizer updates once per every_k calls), concatenated."""
    if len(batches) % every_k:
        raise ValueError(f"the optimizer is optax.MultiSteps, which updates once every {every_k} batches, and "
                         f"{len(batches)} batches is not a whole number of its steps; pass a multiple of {every_k}.")
    groups = [batches[i:i + every_k] for i in range(0, len(batches), every_k)]
    return [g[0] if every_k == 1 else jax.tree.map(lambda *xs: np.concatenate([np.asarray(x) for x in xs]), *g)
            for g in groups]


def multi_steps_inner(optimizer) -> tuple[object, int]:
    """`(the one-device optimizer, calls per optimizer step)`: an `optax.MultiSteps(inner, k)` is
    `(inner, k)` (one step of inner on the k calls' batches together is the definition it
    approximates), anything else `(optimizer, 1)`. A MultiSteps that sums, skips or changes k is refused."""
    if not isinstance(optimizer, optax.MultiSteps):
        return optimizer, 1
    ks = {int(optimizer._every_k_schedule(n)) for n in (0, 1, 2, 1000)}
    skips = "MultiSteps.__init__" not in getattr(optimizer._should_skip_update_fn, "__qualname__", "")
    if len(ks) != 1 or not optimizer._use_grad_mean or skips:
        raise ValueError("optimizer is an optax.MultiSteps with a varying every_k_schedule, use_grad_mean=False or a "
                         "should_skip_update_fn, which has no one-device step to compare with; pass one with a "
                         "constant k (or its inner optimizer with accum_steps=k).")
    return optimizer._opt, ks.pop()


def has_model_state(setup, params_or_model) -> bool:
    """Whether the model has state its steps update (Linen's batch_stats with has_state, an nnx
    model's `BatchStat`s), which makes its micro-batches part of its definition."""
    if isinstance(params_or_model, nnx.Module):
        return bool(jax.tree.leaves(nnx.state(params_or_model, nnx.BatchStat)))
    return bool(setup.has_state)


def _call(setup, params, model_state, batch):
    """(loss, aux, new_model_state) of the user's loss, as declared. Under `mask_key` (a batch entry
    of that name beside a plain loss `sum(mask · l) / b`) the loss and aux are read as jdp reads
    them: `jdp.Weighted(b · loss, sum(mask))`."""
    out = setup.loss_fn(params, model_state, batch) if setup.has_state else setup.loss_fn(params, batch)
    if setup.has_aux and setup.has_state:
        loss, aux, new_state = out[0], out[1][0], out[1][1]
    elif setup.has_aux:
        loss, aux, new_state = out[0], out[1], model_state
    else:
        loss, aux, new_state = (out[0], {}, out[1]) if setup.has_state else (out, {}, model_state)
    return (*_masked(setup, batch, loss, aux), new_state)


def _masked(setup, batch, loss, aux):
    """(loss, aux) as jdp's step reads them: under `mask_key`, a plain loss beside the mask is
    `sum(mask · l) / b`, so `jdp.Weighted(b · loss, sum(mask))`, its aux the same; else as they are."""
    key = setup.mask_key
    if key is None or not isinstance(batch, dict) or key not in batch or is_weighted(loss):
        return loss, aux
    rows, w = len(batch[key]), jnp.sum(batch[key], dtype=jnp.float32)
    return Weighted(loss * rows, w), weighted_aux(aux, lambda a: Weighted(a * rows, w))


def model_loss(setup):
    """An nnx model's loss as `(model, batch) -> (loss, aux)`, read under `mask_key` as `_call` reads it."""
    def loss(model, batch):
        return _masked(setup, batch, *_with_aux(setup.loss_fn, setup.has_aux)(model, batch))
    return loss


def is_weighted_loss(setup, batch, axis: str) -> bool:
    """Whether the loss returns `jdp.Weighted` (traced once on `batch`, nothing computed)."""
    model_state = setup.model_state if setup.has_state else ()
    params = jax.tree.map(jnp.asarray, setup.start)
    traced = jax.vmap(lambda b: _call(setup, params, model_state, b)[0], axis_name=axis)
    out = jax.eval_shape(traced, jax.tree.map(lambda x: np.asarray(x)[None], batch))
    return is_weighted(out)


def is_weighted_model_loss(loss, model, batch) -> bool:
    """Whether `loss(model, batch)` (`model_loss`) returns `jdp.Weighted` (traced once on a copy of
    the model's state, nothing computed, the model left as it was)."""
    graphdef, state = nnx.split(model)
    out = jax.eval_shape(lambda s, b: loss(nnx.merge(graphdef, s, copy=True), b)[0], state, batch)
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

    step_sums = jax.jit(jax.vmap(sums, axis_name=axis))
    step_update = jax.jit(update)
    params = jax.device_put(setup.start, device)
    model_state = jax.device_put(setup.model_state if setup.has_state else (), device)
    opt_state = setup.tx.init(params)
    losses, auxes = [], []
    for batch in batches:
        acc = None
        for micro in micro_batches(batch, m):
            grads, value, w, aux, new_state = _first(step_sums(_one(params), _one(model_state),
                                                               _one(jax.device_put(micro, device))))
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


def micro_batches(batch, m: int) -> list:
    """`batch` (every leaf with the same leading axis) as `m` consecutive micro-batches of equal size."""
    rows = {np.shape(x)[0] for x in jax.tree.leaves(batch)}
    if len(rows) != 1:
        raise ValueError(f"every leaf of a batch needs the same leading (batch) axis; got sizes {sorted(rows)}.")
    (size,) = rows
    if size % m:
        raise ValueError(f"a global batch of {size} examples does not split into accum_steps={m} micro-batches.")
    b = size // m
    return [jax.tree.map(lambda x: x[k * b:(k + 1) * b], batch) for k in range(m)]


def _reference_params(setup, tx, batches, m, axis: str, device):
    """Plain one-device JAX: jit(value_and_grad) and the optax update, on the whole (micro-)batch,
    with `axis` bound on that one device (vmap over a size-1 axis), so collectives in the loss are
    the identity."""

    def one_device(params, opt_state, model_state, batch):
        def loss(p):
            value, aux, new_state = _call(setup, p, model_state, batch)
            return value, (aux, new_state)

        (value, (aux, new_state)), grads = jax.value_and_grad(loss, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, new_state, value, aux

    step = jax.jit(jax.vmap(one_device, axis_name=axis))
    params = jax.device_put(setup.start, device)
    model_state = jax.device_put(setup.model_state if setup.has_state else (), device)
    carry = _one((params, tx.init(params), model_state))
    losses, auxes = [], []
    for batch in batches:
        outs = []
        for micro in micro_batches(batch, m):
            *carry, loss, aux = step(*carry, _one(jax.device_put(micro, device)))
            outs.append((loss[0], _first(aux)))
        losses.append(_mean([o[0] for o in outs]))
        auxes.append(jax.tree.map(lambda *xs: _mean(xs), *[o[1] for o in outs]))
    params, _, model_state = _first(jax.device_get(carry))
    initial = {"params": jax.device_get(setup.start)}
    final = {"params": params}
    if setup.has_state:
        initial["model_state"], final["model_state"] = jax.device_get(setup.model_state), model_state
    return initial, final, jax.device_get(losses), jax.device_get(auxes)


def _reference_model(loss_fn, tx, model, batches, m, device, weighted: bool = False):
    """The one-device nnx loop: nnx.value_and_grad and an nnx.Optimizer, on the whole (micro-)batch;
    `loss_fn` as `model_loss` makes it.

    weighted (a loss that returns `jdp.Weighted`): per optimizer step, the M micro-batches' totals,
    gradients, aux and weights summed, the gradient divided once by the step's weight, then one
    `opt.update` (`tx` is then the optimizer itself, not `optax.MultiSteps`)."""
    with jax.default_device(device):
        model = nnx.clone(model)
        nnx.update(model, jax.device_put(nnx.state(model), device))
        opt = nnx.Optimizer(model, tx, wrt=nnx.Param)

        @nnx.jit
        def step(model, opt, batch):
            (loss, aux), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch)
            opt.update(model, grads)
            return loss, aux

        @nnx.jit
        def sums(model, batch):
            def total(model):
                loss, aux = loss_fn(model, batch)
                w = jnp.asarray(loss.weight, jnp.float32)
                return loss.total, (w, weighted_aux(aux, lambda a: Weighted(a * w, w)))

            (value, (w, aux)), grads = nnx.value_and_grad(total, has_aux=True)(model)
            return grads, value, w, aux

        @nnx.jit
        def update(model, opt, grads, weight):
            opt.update(model, jax.tree.map(lambda g: g / weight, grads))

        def parts(model):
            _, params, _, rest = nnx.split(model, nnx.Param, nnx.RngState, ...)
            return {"params": jax.device_get(params), "model_state": jax.device_get(rest)}

        initial = parts(model)
        losses, auxes = [], []
        for batch in batches:
            micros = [jax.device_put(micro, device) for micro in micro_batches(batch, m)]
            if weighted:
                acc = None
                for micro in micros:
                    call = sums(model, micro)
                    acc = call if acc is None else jax.tree.map(jnp.add, acc, call)
                grads, value, w, aux = acc
                update(model, opt, grads, w)
                losses.append(np.float32(value / w))
                auxes.append(jax.device_get(ratios(aux)))
                continue
            outs = [step(model, opt, micro) for micro in micros]
            losses.append(_mean([o[0] for o in outs]))
            auxes.append(jax.tree.map(lambda *xs: _mean(xs), *[o[1] for o in outs]))
        return initial, parts(model), jax.device_get(losses), jax.device_get(auxes)


def _one(tree):
    """`tree` with a leading axis of size 1: one device's slot of the vmap that binds the loss's axis."""
    return jax.tree.map(lambda x: x[None], tree)


def _first(tree):
    return jax.tree.map(lambda x: x[0], tree)


def _with_aux(loss_fn, has_aux):
    if has_aux:
        return loss_fn
    return lambda *args: (loss_fn(*args), {})


def _mean(values):
    values = [np.asarray(v) for v in values]
    return values[0] if len(values) == 1 else np.mean(np.stack(values).astype(np.float64), 0).astype(values[0].dtype)
