"""Cross-device reductions over the mesh axis `axis` (default `DATA_AXIS`). Each one says the scale of what it returns.

These run inside the per-device step (under `shard_map` or `pmap`), where every device holds the
mean loss and gradient over its own b examples. Each function issues ONE all-reduce for its whole
pytree, so a step communicates once however many leaves it reduces.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jdp.core.mesh import DATA_AXIS
from jdp.core.options import REDUCTIONS


def low_precision(x) -> bool:
    """Whether `x` is fp16/bf16, which jdp divides by N before summing."""
    # Below float32 a sum over many devices can overflow (fp16 max is 65504), so such values are
    # divided by N before they are summed, as PyTorch DDP does.
    return x.dtype in (jnp.float16, jnp.bfloat16)


def _psum_scaled(tree, divide_before, divide_after, axis: str):
    """psum of `tree` in one all-reduce, dividing by N before or after per leaf as flagged."""
    n = lax.axis_size(axis)
    leaves, treedef = jax.tree.flatten(tree)
    sent = [x / n if before else x for x, before in zip(leaves, divide_before)]
    summed = lax.psum(sent, axis)
    out = [s / n if after else s for s, after in zip(summed, divide_after)]
    return jax.tree.unflatten(treedef, out)


def mean_over_devices(tree, axis: str = DATA_AXIS):
    """Mean over the N devices of `axis`, leaf by leaf, in one all-reduce.

    Given per-device means over b examples each, the result is the mean over all N·b examples:
    the value one device would compute on the whole global batch. fp16/bf16 leaves are divided by
    N before the sum, so the reduction cannot overflow where the mean itself would not; other
    leaves are summed, then divided (exactly `lax.pmean`).
    """
    low = [low_precision(x) for x in jax.tree.leaves(tree)]
    return _psum_scaled(tree, low, [not lo for lo in low], axis)


def sum_over_devices(tree, axis: str = DATA_AXIS):
    """Sum over the N devices of `axis`: N times `mean_over_devices` (the psum variant)."""
    n_leaves = len(jax.tree.leaves(tree))
    return _psum_scaled(tree, [False] * n_leaves, [False] * n_leaves, axis)


def reduce_step_values(grads, means, reduction: str, reduce_dtype=None, axis: str = DATA_AXIS):
    """Reduce one step's gradients (by `reduction`) and other values (by mean) in one all-reduce.

    Returns `(grads, means)`: with "mean" the gradient of the mean loss over all N·b examples, with
    "sum" N times it; every leaf of `means` (loss, aux metrics, model state) is averaged over the
    N devices, i.e. per-device means become means over all N·b examples. `reduce_dtype` (e.g.
    jnp.bfloat16) is the dtype the float gradients travel in: cast before the all-reduce (a bf16
    mean is divided by N before the sum) and back to their own dtype after it.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r} is not supported; use one of {REDUCTIONS}.")
    own = [x.dtype for x in jax.tree.leaves(grads)]
    if reduce_dtype is not None:
        grads = jax.tree.map(lambda g: g.astype(reduce_dtype) if jnp.issubdtype(g.dtype, jnp.floating) else g, grads)
    is_grad = [True] * len(own) + [False] * len(jax.tree.leaves(means))
    low = [low_precision(x) for x in jax.tree.leaves((grads, means))]
    divide = [reduction == "mean" or not g for g in is_grad]  # a mean divides by N once
    grads, means = _psum_scaled((grads, means), [d and lo for d, lo in zip(divide, low)],
                                [d and not lo for d, lo in zip(divide, low)], axis)
    leaves, treedef = jax.tree.flatten(grads)
    return jax.tree.unflatten(treedef, [g.astype(d) for g, d in zip(leaves, own)]), means
