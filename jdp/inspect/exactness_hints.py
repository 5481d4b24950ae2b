"""Why `assert_data_parallel_exact` failed, when the cause can be measured on one device.

Three causes are named in a sentence above the report's table:

- `own_count_hint`: the loss is not a mean over examples (a plain loss that divides by its own
  shard's count, or a sum), or a `jdp.Weighted` loss whose total and weight are not sums over
  examples (they do not add up over the device shards).
- `zero_gradient_hint`: the failing leaves have a gradient of ~0 (an attention key bias, a bias
  that feeds a BatchNorm): an optimizer that divides by the gradient's own scale (Adam) turns the
  rounding of a reduction order into steps of the learning rate's size there, however exact the
  reduction is.
- `dropout_hint`, `linen_dropout_hint`: an nnx model's Dropout, or a Linen `nn.Dropout` the loss
  runs with deterministic=False, draws masks, which differ between devices and one device. Checked
  first: dropout makes a loss look like one that divides by its own count.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jdp.core.weighting import is_weighted
from jdp.inspect.reference import _call, _first, _one, model_loss

# A leaf's gradient is ~0 when its max |g| is at most this fraction of the largest leaf's (float32;
# 10 eps of the dtype where that is coarser). docs/testing.md's key bias: 7.2e-9 against 1.4e-1, 5e-8 of it.
ZERO_GRADIENT = 1e-4


def leaves(tree) -> dict[str, np.ndarray]:
    """{".a.b": leaf} with nnx's trailing ".value" dropped: the names the report gives leaves."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = jax.tree_util.keystr(path, simple=True, separator=".")
        name = name.removesuffix(".value") if name != "value" else ""
        out["." + name if name else ""] = np.asarray(leaf)
    return out


def failure_hint(setup, failures, batch, devices: int, what: str, axis: str) -> str | None:
    """The sentence naming the cause of `failures` (LeafDiff rows), measured on `batch` split into
    `devices` parts (`what`: "device shards", or "micro-batches" where only jit runs), or None:
    `dropout_hint` (an nnx model), `linen_dropout_hint`, `own_count_hint` (array params), else
    `zero_gradient_hint`."""
    if isinstance(setup.start, nnx.Module):
        hint = dropout_hint(setup.start)
    else:
        hint = linen_dropout_hint(setup, batch, axis) or own_count_hint(setup, batch, devices, axis, what)
    return hint or zero_gradient_hint(failures, initial_gradients(setup, batch, axis))


def dropout_hint(model) -> str | None:
    """A sentence when the model has an `nnx.Dropout` that draws masks: jdp's devices draw their own
    keys (per device and micro-step), so no run equals one device's."""
    on = [".".join(map(str, path)) or "the model" for path, m in nnx.iter_modules(model)
          if isinstance(m, nnx.Dropout) and not m.deterministic and m.rate > 0]
    if not on:
        return None
    return (f"the model's Dropout ({', '.join(on[:3])}{' ...' if len(on) > 3 else ''}) draws random masks, and "
            f"each device draws its own, so no data-parallel run can take one device's steps; turn it off for this "
            f"check (e.g. model.{on[0]}.deterministic = True, or nnx.Dropout(rate, deterministic=True)).")


def linen_dropout_hint(setup, batch, axis: str) -> str | None:
    """A sentence when the loss (traced once on `batch`, nothing computed) calls a Linen `nn.Dropout`
    with a rate > 0 and deterministic False: its masks are drawn for the shape it is given, so each
    device's (and micro-batch's) differ from one device's on the whole batch."""
    from flax import linen as nn

    on = []

    def spy(next_fun, args, kwargs, context):
        module = context.module
        if isinstance(module, nn.Dropout) and context.method_name == "__call__" and module.rate > 0:
            given = kwargs.get("deterministic", args[1] if len(args) > 1 else None)
            deterministic = module.deterministic if given is None else given
            if isinstance(deterministic, (bool, np.bool_)) and not deterministic:
                on.append("/".join(module.scope.path) if module.scope is not None else module.name or "Dropout")
        return next_fun(*args, **kwargs)

    params = jax.tree.map(jnp.asarray, setup.start)
    model_state = setup.model_state if setup.has_state else ()
    traced = jax.vmap(lambda b: _call(setup, params, model_state, b)[0], axis_name=axis)
    with nn.intercept_methods(spy):
        jax.eval_shape(traced, jax.tree.map(lambda x: np.asarray(x)[None], batch))
    if not on:
        return None
    names = ", ".join(dict.fromkeys(on[:3]))
    return (f"the loss runs Linen's nn.Dropout ({names}{' ...' if len(on) > 3 else ''}) with deterministic=False, "
            f"which draws random masks for the shape it is given, so each device's (and micro-batch's) masks differ "
            f"from one device's on the whole batch and no data-parallel run can take its steps; turn it off for this "
            f"check (apply(..., deterministic=True), or nn.Dropout(rate, deterministic=True)).")


def own_count_hint(setup, batch, devices: int, axis: str, what: str = "device shards") -> str | None:
    """A sentence when the loss is not a mean over examples: on `batch` (one micro-batch) a plain
    loss's value differs from the mean of its values on the `devices` shards (it divides by each
    shard's own count of tokens, or sums), or a `jdp.Weighted` loss's total or weight is not the sum
    of its shards' (a mean where a sum belongs); None when neither is seen (or with model state,
    which shards change)."""
    if setup.has_state or not all(np.shape(x)[0] % devices == 0 for x in jax.tree.leaves(batch)):
        return None
    params = jax.tree.map(jnp.asarray, setup.start)
    value = jax.jit(jax.vmap(lambda b: _call(setup, params, (), b)[0], axis_name=axis))
    stacked = lambda tree, n: jax.tree.map(lambda x: np.asarray(x).reshape(n, -1, *np.shape(x)[1:]), tree)  # noqa: E731
    whole = jax.device_get(_first(value(stacked(batch, 1))))
    shards = [jax.device_get(_first(value(stacked(jax.tree.map(
        lambda x, d=d: np.asarray(x)[np.arange(len(x)) // (len(x) // devices) == d], batch), 1))))
        for d in range(devices)]
    if is_weighted(whole):
        return _weighted_hint(whole, shards, devices, setup.mask_key if isinstance(batch, dict) and setup.mask_key
                              in batch else None, what)
    whole, mean = float(whole), float(np.mean([float(s) for s in shards]))
    if abs(whole - mean) <= 1e-5 * max(1.0, abs(whole)):
        return None
    if abs(whole - devices * mean) <= 1e-4 * max(1.0, abs(whole)):
        return (f"loss_fn is not a mean over examples: on the first batch its value on the whole batch "
                f"({whole:.6g}) is {devices} times the mean of its values on the {devices} {what} "
                f"({mean:.6g}), as a sum over examples is; return the mean (jdp averages over devices), or jdp.Weighted(sum, count).")
    return (f"loss_fn is not a mean over examples: on the first batch its value on the whole batch ({whole:.6g}) "
            f"differs from the mean of its values on the {devices} {what} ({mean:.6g}), as when it divides by "
            f"each {'shard' if what == 'device shards' else 'micro-batch'}'s own count of real tokens; return "
            f"jdp.Weighted(sum of the losses, their count) so that jdp divides by the global count once.")


def _weighted_hint(whole, shards, devices: int, mask_key: str | None, what: str) -> str | None:
    for field in ("total", "weight"):
        value, parts = float(getattr(whole, field)), float(np.sum([float(getattr(s, field)) for s in shards]))
        if abs(value - parts) > 1e-5 * max(1.0, abs(value)) and mask_key is not None:
            return (f"loss_fn is not sum(mask · loss) / b under mask_key={mask_key!r}: on the first batch b times its "
                    f"value is {value:.6g} on the whole batch and {parts:.6g} summed over the {devices} {what}, "
                    f"as when it divides by the shard's own count of real examples; divide by the batch size b "
                    f"(jdp divides by the global count of real examples), or return jdp.Weighted(sum, count).")
        if abs(value - parts) > 1e-5 * max(1.0, abs(value)):
            return (f"loss_fn returns jdp.Weighted whose {field} is not a sum over examples: on the first batch it is "
                    f"{value:.6g} on the whole batch and {parts:.6g} summed over the {devices} {what}; return "
                    f"jdp.Weighted(sum of the losses, sum of their weights), e.g. jnp.sum(mask * loss) and "
                    f"jnp.sum(mask): jdp divides the one by the other once, over the global batch.")
    return None


def initial_gradients(setup, batch, axis: str):
    """The one-device gradient of the loss at the initial params on `batch` (one micro-batch), as
    {"params": tree}; a `jdp.Weighted` loss differentiated as total / weight."""
    def scalar(value):
        return value.total / jnp.asarray(value.weight, jnp.float32) if is_weighted(value) else value

    if isinstance(setup.start, nnx.Module):
        graphdef, params, rest = nnx.split(setup.start, nnx.Param, ...)

        loss = model_loss(setup)
        grad = jax.grad(lambda p, b: scalar(loss(nnx.merge(graphdef, p, rest, copy=True), b)[0]))
        return {"params": jax.device_get(jax.jit(grad)(params, batch))}
    model_state = setup.model_state if setup.has_state else ()
    grad = jax.vmap(lambda p, b: jax.grad(lambda q: scalar(_call(setup, q, model_state, b)[0]))(p), axis_name=axis)
    return {"params": jax.device_get(_first(jax.jit(grad)(_one(jax.tree.map(jnp.asarray, setup.start)),
                                                          _one(batch))))}


def zero_gradient_hint(failures, gradients) -> str | None:
    """A sentence when failing params leaves have a gradient of ~0 (`ZERO_GRADIENT` of the largest
    leaf's, from `initial_gradients`), naming them and the ways to check them; None otherwise."""
    scales = {"params" + name: float(np.max(np.abs(g.astype(np.float64)))) if g.size else 0.0
              for name, g in leaves(gradients["params"]).items()}
    dtypes = {"params" + name: g.dtype for name, g in leaves(gradients["params"]).items()}
    top = max(scales, key=scales.get, default=None)
    if top is None or scales[top] == 0:
        return None
    zero = {}
    for row in failures:
        if row.name in scales and row.name not in zero:
            eps = float(jnp.finfo(dtypes[row.name]).eps) if jnp.issubdtype(dtypes[row.name], jnp.inexact) else 0.0
            if scales[row.name] <= max(ZERO_GRADIENT, 10 * eps) * scales[top]:
                zero[row.name] = row
    if not zero:
        return None
    names = ", ".join(zero)
    worst = max(r.diff for r in zero.values())
    atol = float(f"{10 ** np.ceil(np.log10(2 * worst)):.0e}")
    others = {r.name for r in failures} - set(zero)
    rest = (f"; the other failing leaves ({len(others)}) have gradients of their own: look at them first"
            if others else "")
    return (f"{names}: {'its' if len(zero) == 1 else 'their'} gradient is ~0 on the first batch (max |g| "
            f"{max(scales[n] for n in zero):.1e}, against {scales[top]:.1e} for {top}), as an attention key bias's "
            f"or that of a bias before a BatchNorm is: an optimizer that divides by the gradient's own scale (Adam) "
            f"turns the rounding of the reduction order into steps of the learning rate's size there, so it differs "
            f"from one device however exact the step is; check it with optax.sgd, a larger eps (e.g. "
            f"optax.adam(lr, eps=1e-3)), or atol_for={{{next(iter(zero))!r}: {atol:g}}}"
            f"{rest}.")
