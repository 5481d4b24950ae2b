"""Exact evaluation over a whole dataset: sums and counts reduced across devices, never means of means."""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jdp.data import MASK_KEY, make_batches
from jdp.mesh import DATA_AXIS, batch_sharded, replicated


def make_eval_step(metric_fn: Callable, mesh):
    """A jitted `(params, model_state, batch) -> (sums, count)` over `mesh`.

    `metric_fn(params, model_state, batch) -> {name: per-example values (b,)}`. Each device sums its
    masked values; the sums and the count of real examples are added over devices (psum), so the
    ratio is exact whatever the padding of the last batch.
    """
    def device_eval(params, model_state, batch):
        values = metric_fn(params, model_state, batch)
        mask = batch[MASK_KEY]
        sums = {k: jnp.sum(v.astype(jnp.float32) * mask) for k, v in values.items()}
        return lax.psum((sums, jnp.sum(mask)), DATA_AXIS)

    return jax.jit(jax.shard_map(device_eval, mesh=mesh, in_specs=(P(), P(), P(DATA_AXIS)),
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
