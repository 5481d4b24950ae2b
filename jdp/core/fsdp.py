"""Params, gradient and optimizer state sharded over the data-parallel devices (FSDP, ZeRO stage 3), the same step.

ZeRO-1 (`jdp.zero.ShardedStateLayout`) keeps 4 + 4 + 8/N bytes per parameter on each device for
Adam in float32: the params and the gradient stay whole. `FullyShardedLayout` keeps the params in
slices too, so that between steps each device holds (4 + 8)/N bytes per parameter (plus padding):

1. every device all-gathers the params, one `lax.all_gather` per leaf, into their shapes;
2. it computes its mean loss over its b examples and the gradient, whole, w.r.t. those params;
3. one reduce-scatter (`lax.psum_scatter`, with the mean's 1/N) leaves device d the global-mean
   gradient of slice d of every leaf (the same cut as ZeRO-1: each leaf flattened and padded with
   zeros to N·c elements, device d holding elements [d·c, (d+1)·c));
4. the optimizer updates slice d of the params with slice d of its state; the new params stay in
   slices: the next call gathers them (step 1) instead of this one.

Per call the traffic is the ring all-reduce's, 2(N−1)/N · P bytes: an all-gather of the params
and a reduce-scatter of the gradient, (N−1)/N · P each. With precision="bfloat16" the float32
slices are cast to bfloat16 before the gather, which halves its bytes and gives the loss exactly
the bf16 params it would compute with anyway (the replicated step casts them inside the loss);
the gradient w.r.t. them is cast back to float32 before the reduce-scatter, as the replicated
step's cast does in the backward pass, so the result is the replicated step's, bit for bit. With accum_steps = M the params are
gathered on each of the M calls; accum_sync="last" keeps each device's gradient sums whole (its
accumulator is P bytes) and reduce-scatters them once per optimizer step, "every" reduce-scatters
every call and accumulates slices (in optax.MultiSteps' sharded state).

The gather is of the whole model before the forward pass: the gathered params live until the
backward pass has used them, so a step's peak still holds the whole params (and the whole
gradient) once; only the state between steps is 1/N. The optimizer must be elementwise, as for
ZeRO-1 (`jdp.zero.check_elementwise`), and global-norm clipping takes the norm over every
device's slice (`jdp.zero.clip_by_global_norm`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jdp.core.mesh import replicated
from jdp.core.precision import DTYPES
from jdp.core.state import TrainState
from jdp.core.zero import ShardedStateLayout


@dataclass(frozen=True)
class ParamShard:
    """One params leaf between steps: its flattened, zero-padded (N·c,) global array split along
    the data axis (device d holds elements [d·c, (d+1)·c)), and the leaf's own shape."""

    value: Any
    shape: tuple[int, ...] = field(metadata={"static": True})

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def whole(self) -> np.ndarray:
        """The leaf on the host in its shape (padding dropped); collective if it spans processes."""
        value = self.value
        if isinstance(value, jax.Array) and not value.is_fully_addressable:
            value = jax.jit(lambda v: v, out_shardings=NamedSharding(value.sharding.mesh, P()))(value)
            value = value.addressable_data(0)
        return np.asarray(jax.device_get(value)).reshape(-1)[:self.size].reshape(self.shape)


jax.tree_util.register_dataclass(ParamShard)


def is_shard(x) -> bool:
    """Whether `x` is a `ParamShard` (an `is_leaf` for tree maps that must stop at one)."""
    return isinstance(x, ParamShard)


def whole_params(tree):
    """`tree` with every `ParamShard` replaced by its host leaf in its shape; other leaves as they are."""
    return jax.tree.map(lambda x: x.whole() if is_shard(x) else x, tree, is_leaf=is_shard)


class FullyShardedLayout(ShardedStateLayout):
    """`jax.shard_map` with params and optimizer state sharded: every params leaf is a `ParamShard`
    whose (N·c_i,) value is split along the data axis, and so is every param-shaped leaf of the
    optimizer state (its scalars replicated). Model state (BatchNorm statistics) stays replicated.
    `bind(params)` sets the shardings from the params' shapes (`TrainStep.init` calls it).
    """

    name = "fsdp"

    def __init__(self, mesh, accum: str | None, optimizer, precision: str = "float32"):
        super().__init__(mesh, accum, optimizer)
        self.axis = mesh.axis_names[0]
        self.compute_dtype = DTYPES[precision]  # what the loss computes in: the dtype the params are gathered in

    def state_specs(self, opt_specs) -> TrainState:
        return super().state_specs(opt_specs).replace(params=P(self.axis))

    def per_device(self, params):
        """The whole params in their shapes for the forward and backward pass: one all-gather
        per leaf (of its N·c_i elements, the first s_i kept), outside the differentiated loss, so
        the gradient is this device's own, w.r.t. the whole params. Float32 leaves travel in the
        compute dtype (bfloat16 with precision="bfloat16", which the loss casts them to anyway)."""
        def whole(shard: ParamShard):
            value = shard.value
            if value.dtype == jnp.float32 and self.compute_dtype != jnp.float32:
                value = value.astype(self.compute_dtype)
            flat = lax.all_gather(value, self.axis, tiled=True)
            return flat[:shard.size].reshape(shard.shape)

        return jax.tree.map(whole, params, is_leaf=is_shard)

    def reduce(self, grads, means, o):
        """`ShardedStateLayout.reduce` of the gradient in the params' own dtypes (a gradient w.r.t.
        params gathered in bfloat16 is cast back to float32 first, exactly, as the replicated
        step's cast inside the loss does)."""
        grads = jax.tree.map(lambda g, leaf: g.astype(leaf.dtype), grads, self.slices.struct)
        return super().reduce(grads, means, o)

    def own(self, params):
        """This device's (c_i,) slice of every leaf: what the state already holds."""
        return jax.tree.map(lambda s: s.value, params, is_leaf=is_shard)

    def gather(self, params):
        """The updated slices stay where they are (the next call gathers them)."""
        return jax.tree.map(lambda x, leaf: ParamShard(x, leaf.shape), params, self.slices.struct)

    def spread(self, state: TrainState) -> TrainState:
        """The canonical params and optimizer state, each leaf flattened and padded (inside jit)."""
        state = super().spread(state)
        shards = jax.tree.map(lambda x, c: ParamShard(self.slices.padded(x, c), tuple(np.shape(x))),
                              state.params, self.slices.chunk_tree())
        return state.replace(params=shards)

    def canonical(self, state: TrainState) -> TrainState:
        """Params and optimizer state as the replicated layout holds them: padding dropped,
        leaves in their shapes, replicated."""
        def unpad(shard: ParamShard):
            return jax.device_put(shard.value[:shard.size].reshape(shard.shape), replicated(self.mesh))

        state = super().canonical(state)
        return state.replace(params=jax.tree.map(unpad, state.params, is_leaf=is_shard))
