"""Cross-device reductions over `DATA_AXIS`. Each one says the scale of what it returns.

These run inside the per-device step (under `shard_map` or `pmap`), where every device holds the
mean loss and gradient over its own b examples.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jdp.mesh import DATA_AXIS

REDUCTIONS = ("mean", "sum")

# Below float32 a sum over many devices can overflow (fp16 max is 65504), so such values are
# divided by N before they are summed, as PyTorch DDP does.
_LOW_PRECISION = (jnp.float16, jnp.bfloat16)


def _mean_leaf(x: jax.Array) -> jax.Array:
    if x.dtype in _LOW_PRECISION:
        return lax.psum(x / lax.axis_size(DATA_AXIS), DATA_AXIS)
    return lax.pmean(x, DATA_AXIS)


def mean_over_devices(tree):
    """Mean over the N devices of `DATA_AXIS`, leaf by leaf.

    Given per-device means over b examples each, the result is the mean over all N·b examples:
    the value one device would compute on the whole global batch. fp16/bf16 leaves are divided by
    N before the sum, so the reduction cannot overflow where the mean itself would not.
    """
    return jax.tree.map(_mean_leaf, tree)


def sum_over_devices(tree):
    """Sum over the N devices of `DATA_AXIS`: N times `mean_over_devices` (the psum variant)."""
    return jax.tree.map(lambda x: lax.psum(x, DATA_AXIS), tree)


def reduce_gradients(grads, reduction: str):
    """Reduce per-device gradients with `reduction` ("mean": the global-batch gradient; "sum": N× it)."""
    if reduction == "mean":
        return mean_over_devices(grads)
    if reduction == "sum":
        return sum_over_devices(grads)
    raise ValueError(f"reduction={reduction!r} is not supported; use one of {REDUCTIONS}.")
