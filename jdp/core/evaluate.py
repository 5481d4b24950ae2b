"""Exact evaluation over a whole dataset: sums and counts reduced across devices, never means of means."""
from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jdp.core.mesh import batch_sharded, data_axes, replicated
from jdp.core.weighting import Weighted, is_weighted
from jdp.data import MASK_KEY, make_batches


def make_eval_step(metric_fn: Callable, mesh):
    """A jitted `(params, model_state, batch) -> (sums, count)` over `mesh`.

    `metric_fn(params, model_state, batch) -> {name: values}`: per-example values of shape (b,), or
    `jdp.Weighted(total, weight)` of arrays with the leading batch axis, e.g. (b, L) per-token losses
    times their mask and the mask. Each device sums its values over its real (unpadded) rows; the
    sums, the Weighted weights and the count of real examples are added over devices (psum), so the
    ratios are exact whatever the padding of the last batch and the token counts.
    """
    axis = data_axes(mesh)

    def device_eval(params, model_state, batch):
        values = metric_fn(params, model_state, batch)
        mask = batch[MASK_KEY]
        sums = {name: _masked_sums(name, v, mask) for name, v in values.items()}
        return lax.psum((sums, jnp.sum(mask)), axis)

    return jax.jit(jax.shard_map(device_eval, mesh=mesh, in_specs=(P(), P(), P(axis)),
                                 out_specs=P(), check_vma=False))


def _masked_sums(name: str, value, mask):
    """One metric's sum over the real rows (`mask`: (b,) 1/0): a scalar, or a Weighted of two."""
    if is_weighted(value):
        for field, x in (("total", value.total), ("weight", value.weight)):
            if jnp.ndim(x) == 0 or jnp.shape(x)[0] != mask.shape[0]:
                raise ValueError(f"metric_fn's {name!r} is a jdp.Weighted whose {field} has shape {jnp.shape(x)}; "
                                 f"both need the leading batch axis ({mask.shape[0]}, ...) so that padded rows can "
                                 f"be left out, e.g. per-token values times the mask, and the mask.")
        rows = lambda x: jnp.sum(x.astype(jnp.float32) * mask.reshape(-1, *[1] * (x.ndim - 1)))  # noqa: E731
        return Weighted(rows(value.total), rows(value.weight))
    if jnp.shape(value) != mask.shape:
        raise ValueError(f"metric_fn's {name!r} has shape {jnp.shape(value)}; it must hold one value per "
                         f"example, shape {mask.shape}, so that padded examples can be left out, or be "
                         f"jdp.Weighted(values · weights, weights) of per-token arrays ({mask.shape[0]}, ...).")
    return jnp.sum(value.astype(jnp.float32) * mask)


def evaluate(eval_step, params, model_state, dataset, batch_size: int, mesh) -> dict[str, float]:
    """Means of the metrics over every example of `dataset` (one pass, the last batch padded)."""
    n_devices = mesh.devices.size
    batch_size = max(n_devices, batch_size - batch_size % n_devices)
    batches = make_batches(dataset, batch_size, drop_last=False, prefetch=0)
    params, model_state = jax.device_put((params, model_state), replicated(mesh))
    totals, count = None, 0.0
    for _ in range(batches.steps_per_epoch):
        sums, n = eval_step(params, model_state, jax.device_put(next(batches), batch_sharded(mesh)))
        totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)  # Weighted: both fields
        count += n
    batches.close()
    totals, count = jax.device_get((totals, count))
    return {k: float(np.asarray(v.total) / np.asarray(v.weight)) if is_weighted(v) else float(np.asarray(v) / count)
            for k, v in totals.items()}


@functools.lru_cache(maxsize=16)
def _cached_eval_step(metric_fn: Callable, mesh):
    return make_eval_step(metric_fn, mesh)  # compiled once per (metric_fn, mesh), not per evaluation


def evaluate_state(step, state, metric_fn: Callable, data, batch_size: int = 256) -> dict[str, float]:
    """Exact means of `metric_fn`'s values over every example (or token) of `data`, on `step`'s devices.

    `metric_fn(params, model_state, batch)`, or `metric_fn(params, batch)` for a model without
    state, returns `{name: values}`: per-example values of shape (b,), or `jdp.Weighted(values ·
    weights, weights)` of per-token arrays (b, L) for a mean over tokens. `data` is a dict of arrays
    with one leading axis or any source `jdp.data.make_batches` takes (a token file, a
    `grain.MapDataset`, ...). Each device sums its share, the last batch is padded and masked, and
    sums, weights and counts are added over devices: the result is what one device computes on the
    whole set, whatever the device count or batch size.
    """
    canonical = step.canonical(state)
    return evaluate(_cached_eval_step(_with_model_state(metric_fn), step.mesh), canonical.params,
                    canonical.model_state, data, batch_size, step.mesh)


@functools.lru_cache(maxsize=64)
def _with_model_state(metric_fn: Callable) -> Callable:
    """`metric_fn` as `(params, model_state, batch)`: a two-argument one `(params, batch)` ignores the state."""
    try:
        inspect.signature(metric_fn).bind(None, None, None)
        return metric_fn
    except TypeError:
        return lambda params, model_state, batch: metric_fn(params, batch)
    except ValueError:  # no signature (a builtin): take it as written for the three arguments
        return metric_fn
