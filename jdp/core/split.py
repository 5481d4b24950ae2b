"""Params a model gathers itself: a device's block of a leaf, marked with the dimension it was split along.

Under `shard_params=True` with `gather_in_model=True` the loss receives every split params leaf
as a `Split`: this device's block and how to make it whole. A model that runs its layers in a
`jax.lax.scan` (jdp's GPT with `scan_layers=True`) calls `gather` on one layer's params inside
the scan body, so only that layer is whole at a time; the all-gather's transpose is a
reduce-scatter, so the backward pass reduce-scatters each layer's gradient as it makes it; a
stacked leaf split along its layers is gathered whole before the scan (`gather_layer_axis`).
Outside the sharded layout `gather` returns its argument: the same model code runs everywhere.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax


@dataclass(frozen=True)
class Split:
    """This device's block `value` of a params leaf split along dimension `dim` (negative: counted
    from the last, so it holds for one layer's slice of a stacked leaf too) over mesh axis `axis`;
    `compute`: the dtype the loss computes in (set by its precision cast), which the gather yields."""

    value: Any
    dim: int
    axis: str
    compute: str | None = None

    def astype(self, dtype) -> Split:
        """The precision cast: recorded, applied by `whole` with the gather (whose transpose
        reduce-scatters the gradient in the block's own dtype)."""
        return Split(self.value, self.dim, self.axis, jnp.dtype(dtype).name)

    @property
    def dtype(self):
        return self.value.dtype

    def _refuse(self, *_args, **_kwargs):
        raise TypeError(f"a params leaf under gather_in_model=True is a jdp.fsdp.Split, this device's block of "
                        f"it (shape {tuple(self.value.shape)}, split along dimension {self.dim}), not an array; "
                        f"gather it first with jdp.fsdp.gather(leaf) (or jdp.fsdp.gather(params) for a whole "
                        f"subtree, inside the layer that uses it).")

    # Indexing or computing with a block instead of the whole leaf: one sentence naming the fix.
    __getitem__ = __matmul__ = __rmatmul__ = __add__ = __radd__ = __sub__ = __rsub__ = _refuse
    __mul__ = __rmul__ = __truediv__ = __rtruediv__ = __pow__ = __neg__ = __array__ = _refuse

    def whole(self) -> jax.Array:
        """The whole leaf (one all-gather along `dim`), in the compute dtype."""
        dtype = self.value.dtype if self.compute is None else jnp.dtype(self.compute)
        return _gather(self.value, self.value.ndim + self.dim, self.axis, dtype)


jax.tree_util.register_dataclass(Split, data_fields=["value"], meta_fields=["dim", "axis", "compute"])


def is_split(x) -> bool:
    """Whether `x` is a `Split` block (an `is_leaf` for tree maps that must stop at one)."""
    return isinstance(x, Split)


def gather(tree):
    """`tree` with every `Split` leaf made whole (an all-gather each); any other leaf as it is.

    Call it inside a scanned, rematerialised layer on that layer's params: the gather's transpose
    reduce-scatters the layer's gradient in the backward pass, summed over the devices.
    """
    return jax.tree.map(lambda x: x.whole() if is_split(x) else x, tree, is_leaf=is_split)


def gather_layer_axis(stack):
    """A scanned model's stacked params (`stack`, leading axis: the layers) with every `Split` that
    is split along that axis made whole (an all-gather each), before the scan; the others stay
    blocks, for the scan body to `gather` one layer at a time.

    The split axis is a leaf's largest after the first that N divides, else the first
    (`jdp.zero.split_dim`): a stacked leaf no other dimension of which divides (a (3, 16) layer norm
    on 3 devices) is split along its layers, and a scan over that block would see L/N of them.
    Whole, it costs what a replicated leaf does during the step and stays 1/N between steps; its
    gradient is reduce-scattered by the gather's transpose, as the other leaves' are.
    """
    return jax.tree.map(lambda x: x.whole() if is_split(x) and x.value.ndim + x.dim == 0 else x, stack,
                        is_leaf=is_split)


@partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _gather(x, dim: int, axis: str, dtype):
    """All-gather of block `x` along `dim` in `dtype` (cast first: a bf16 gather sends half the bytes);
    the transpose reduce-scatters the gradient in `x`'s own dtype (a bf16 gradient cast to float32
    first, as the replicated step's cast does), summed over the devices."""
    return lax.all_gather(x.astype(dtype), axis, axis=dim, tiled=True)


def _gather_fwd(x, dim, axis, dtype):
    return _gather(x, dim, axis, dtype), jnp.zeros((), x.dtype)


def _gather_bwd(dim, axis, dtype, like, g):
    return (lax.psum_scatter(g.astype(like.dtype), axis, scatter_dimension=dim, tiled=True),)


_gather.defvjp(_gather_fwd, _gather_bwd)
