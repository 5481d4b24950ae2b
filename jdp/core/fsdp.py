"""Params, gradient and optimizer state sharded over the data-parallel devices (FSDP, ZeRO stage 3), the same step.

ZeRO-1 (`jdp.zero.ShardedStateLayout`) keeps 4 + 4 + 8/N bytes per parameter on each device for
Adam in float32: the params and the gradient stay whole. `FullyShardedLayout` keeps the params
split too, in their own shapes (each leaf along one of its dimensions, `jdp.zero.split_dim`; a leaf
no dimension of which N divides stays whole), so that between steps each device holds about
(4 + 8)/N bytes per parameter:

1. every device all-gathers the params, one `lax.all_gather` per leaf along its split dimension;
2. it computes its mean loss over its b examples and the gradient, whole, w.r.t. those params;
3. one reduce-scatter per dtype (`lax.psum_scatter`, with the mean's 1/N) leaves device d the
   global-mean gradient of its block of every split leaf (the whole leaves' gradient travels in
   the small all-reduce of the loss);
4. the optimizer updates the blocks, its update run as written for whole arrays
   (`jdp.core.blockwise`); the new params stay split: the next call gathers them (step 1).

Per call the traffic is the ring all-reduce's, 2(N−1)/N · P bytes: an all-gather of the params
and a reduce-scatter of the gradient, (N−1)/N · P each. With precision="bfloat16" the float32
blocks are cast to bfloat16 before the gather, which halves its bytes and gives the loss exactly
the bf16 params it would compute with anyway (the replicated step casts them inside the loss);
the gradient w.r.t. them is cast back to float32 before the reduce-scatter, as the replicated
step's cast does in the backward pass, so the result is the replicated step's, bit for bit. With
accum_steps = M the params are gathered on each of the M calls; accum_sync="last" keeps each
device's gradient sums whole (its accumulator is P bytes) and reduce-scatters them once per
optimizer step, "every" reduce-scatters every call and accumulates blocks (in optax.MultiSteps'
sharded state).

The gather is of the whole model before the forward pass: the gathered params live until the
backward pass has used them, so a step's peak still holds the whole params (and the whole
gradient) once; only the state between steps is 1/N.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jdp.core.mesh import replicated
from jdp.core.blockwise import WHOLE
from jdp.core.precision import DTYPES
from jdp.core.reduce import reduce_step_values
from jdp.core.split import Split, is_split
from jdp.core.state import LocalAccum, TrainState
from jdp.core.zero import ShardedStateLayout


def host_whole(x) -> np.ndarray:
    """A (possibly split) global array whole on the host, in its shape; collective if it spans processes."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        x = jax.jit(lambda v: v, out_shardings=NamedSharding(x.sharding.mesh, P()))(x).addressable_data(0)
    return np.asarray(jax.device_get(x))


def whole_params(tree):
    """`tree` with every array whole on the host, in its shape (split leaves gathered)."""
    return jax.tree.map(host_whole, tree)


class FullyShardedLayout(ShardedStateLayout):
    """`jax.shard_map` with params and optimizer state split: every params leaf is one global array
    in its own shape, split along its `Cuts` dimension (or whole), and so is every optimizer state
    leaf shaped like its param. Model state (BatchNorm statistics) stays replicated.
    `bind(params)` sets the shardings from the params' shapes (`TrainStep.init` calls it).
    """

    name = "fsdp"

    def __init__(self, mesh, accum: str | None, optimizer, precision: str = "float32", in_model: bool = False):
        super().__init__(mesh, accum, optimizer)
        self.compute_dtype = DTYPES[precision]  # what the loss computes in: the dtype the params are gathered in
        self.in_model = in_model  # gather_in_model: the loss gets `Split` blocks and gathers them itself

    def state_specs(self, opt_specs) -> TrainState:
        return super().state_specs(opt_specs).replace(params=self.cuts.specs())

    def per_device(self, params):
        """The whole params in their shapes for the forward and backward pass: one all-gather
        per split leaf, outside the differentiated loss, so the gradient is this device's own,
        w.r.t. the whole params. Float32 leaves travel in the compute dtype (bfloat16 with
        precision="bfloat16", which the loss casts them to anyway)."""
        if self.in_model:
            return self.marked(params)
        dtype = None if self.compute_dtype == jnp.float32 else self.compute_dtype
        leaves = self.cuts.treedef.flatten_up_to(params)
        return self.cuts.treedef.unflatten([self.cuts.gather_leaf(x, i, dtype) for i, x in enumerate(leaves)])

    def marked(self, tree):
        """gather_in_model: every split leaf of `tree` (this device's blocks) as a `Split` the model gathers."""
        leaves = self.cuts.treedef.flatten_up_to(tree)
        return self.cuts.treedef.unflatten([x if k == WHOLE else Split(x, k - x.ndim, self.shard_axis)
                                            for x, k in zip(leaves, self.cuts.dims)])

    def reduce(self, grads, means, o):
        """`ShardedStateLayout.reduce` of the gradient in the params' own dtypes (a gradient w.r.t.
        params gathered in bfloat16 is cast back to float32 first, exactly, as the replicated
        step's cast inside the loss does). gather_in_model: the split leaves' gradient arrives
        reduce-scattered already (the gathers' transposes, summed over the devices; hybrid: over a
        group's, then summed across the groups in one all-reduce): divided by N for "mean"; the
        whole leaves' travels with the means in one small all-reduce."""
        if not self.in_model:
            grads = jax.tree.map(lambda g, leaf: g.astype(leaf.dtype), grads, self.cuts.struct)
            return super().reduce(grads, means, o)
        leaves = self.cuts.treedef.flatten_up_to(grads)
        whole = [i for i, x in enumerate(leaves) if not is_split(x)]
        small, means = reduce_step_values([leaves[i] for i in whole], means, o.reduction, None, self.axis)
        scale = self.num_devices if o.reduction == "mean" else 1
        split = iter(self.cuts.across_replicas([x.value for x in leaves if is_split(x)]))  # hybrid: over groups
        out = [next(split) / scale if is_split(x) else x for x in leaves]
        for i, g in zip(whole, small):
            out[i] = g
        return self.cuts.treedef.unflatten(out), means

    def global_norm(self, grads):
        """`ShardedStateLayout.global_norm`; `Split` gradients (gather_in_model, between updates) by their blocks."""
        return super().global_norm(jax.tree.map(lambda x: x.value if is_split(x) else x, grads, is_leaf=is_split))

    def empty_accum(self, params, aux) -> LocalAccum | None:
        """As `ShardMapLayout.empty_accum`; with gather_in_model the gradient sums of split leaves
        are this device's blocks (they arrive reduce-scattered), one row per device."""
        accum = super().empty_accum(params, aux)
        if not (self.in_model and self.accum == "per_device"):
            return accum
        rows = self.cuts.treedef.flatten_up_to(accum.grads)
        blocks = [x if k == WHOLE else Split(jnp.zeros((x.shape[0], *self._block(x.shape[1:], k)), x.dtype),
                                             k - (x.ndim - 1), self.shard_axis)
                  for x, k in zip(rows, self.cuts.dims)]
        return accum._replace(grads=self.cuts.treedef.unflatten(blocks))

    def _block(self, shape, k):
        return tuple(s // self.group if d == k else s for d, s in enumerate(shape))

    def own(self, params):
        """This device's block of every leaf: what the state already holds."""
        return params

    def gather(self, params):
        """The updated blocks stay where they are (the next call gathers them)."""
        return params

    def canonical(self, state: TrainState) -> TrainState:
        """Params and optimizer state as the replicated layout holds them: the same shapes, replicated."""
        state = super().canonical(state)
        return state.replace(params=jax.device_put(state.params, replicated(self.mesh)))
