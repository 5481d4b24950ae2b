"""Exact evaluation over a whole dataset: sums and counts reduced across devices, never means of means."""
from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jdp.core.mesh import batch_sharded, replicated
from jdp.data import MASK_KEY, make_batches


def make_eval_step(metric_fn: Callable, mesh):
    """A jitted `(params, model_state, batch) -> (sums, count)` over `mesh`.

    `metric_fn(params, model_state, batch) -> {name: per-example values (b,)}`. Each device sums its
    masked values; the sums and the count of real examples are added over devices (psum), so the
    ratio is exact whatever the padding of the last batch.
    """
    axis = mesh.axis_names[0]

    def device_eval(params, model_state, batch):
        values = metric_fn(params, model_state, batch)
        mask = batch[MASK_KEY]
        for name, v in values.items():
            if jnp.shape(v) != mask.shape:
                raise ValueError(f"metric_fn's {name!r} has shape {jnp.shape(v)}; it must hold one value per "
                                 f"example, shape {mask.shape}, so that padded examples can be left out.")
        sums = {k: jnp.sum(v.astype(jnp.float32) * mask) for k, v in values.items()}
        return lax.psum((sums, jnp.sum(mask)), axis)

    return jax.jit(jax.shard_map(device_eval, mesh=mesh, in_specs=(P(), P(), P(axis)),
                                 out_specs=P(), check_vma=False))


def evaluate(eval_step, params, model_state, dataset, batch_size: int, mesh) -> dict[str, float]:
    """Means of the metrics over every example of `dataset` (one pass, the last batch padded)."""
    n_devices = mesh.devices.size
    batch_size = max(n_devices, batch_size - batch_size % n_devices)
    batches = make_batches(dataset, batch_size, drop_last=False, prefetch=0)
    params, model_state = jax.device_put((params, model_state), replicated(mesh))
    totals, count = None, 0.0
    for _ in range(batches.steps_per_epoch):
        sums, n = eval_step(params, model_state, jax.device_put(next(batches), batch_sharded(mesh)))
        totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
        count += n
    batches.close()
    totals, count = jax.device_get((totals, count))
    return {k: float(np.asarray(v) / count) for k, v in totals.items()}


@functools.lru_cache(maxsize=16)
def _cached_eval_step(metric_fn: Callable, mesh):
    return make_eval_step(metric_fn, mesh)  # compiled once per (metric_fn, mesh), not per evaluation


def evaluate_state(step, state, metric_fn: Callable, data, batch_size: int = 256) -> dict[str, float]:
    """Exact means of `metric_fn`'s per-example values over every example of `data`, on `step`'s devices.

    `metric_fn(params, model_state, batch) -> {name: values of shape (b,)}`; `data` is a dict of
    arrays with one leading axis or any source `jdp.data.make_batches` takes (a token file, a
    `grain.MapDataset`, ...). Each device sums its share, the
    last batch is padded and masked, and sums and counts are added over devices: the result is
    what one device computes on the whole set, whatever the device count or batch size.
    """
    canonical = step.canonical(state)
    return evaluate(_cached_eval_step(metric_fn, step.mesh), canonical.params, canonical.model_state, data,
                    batch_size, step.mesh)
