"""The optimizer state sharded over the data-parallel devices (ZeRO stage 1), the same step.

Data parallelism replicates params, gradient and optimizer state on every device; for Adam in
float32 that is 16 bytes per parameter (params 4, gradient 4, moments 8). `ShardedStateLayout`
keeps one N-th of the optimizer state on each device, in the params' own shapes:

1. each leaf is split along one of its own dimensions that N divides (its largest such one
   after the first, `split_dim`): device d holds indices [d·s/N, (d+1)·s/N) of it. A leaf no dimension of which N
   divides (a bias of 5 on 4 devices, a scalar) is kept whole on every device;
2. every device computes its mean gradient over its b examples (the whole gradient, as before);
3. one reduce-scatter (`lax.psum_scatter`, with the mean's 1/N) per dtype leaves device d the
   global-mean gradient of its block of every split leaf; the whole leaves' gradient travels in
   the small all-reduce of the loss and metrics;
4. the optimizer's update, written for whole arrays, runs on the blocks (`jdp.core.blockwise`):
   elementwise parts block by block, every reduction over a split dimension completed with one
   all-reduce, so `optax.clip_by_global_norm` sees the whole gradient's norm, `optax.adamw`'s mask
   sees each leaf's own `ndim`, `optax.adafactor` factors each leaf by its own shape, and
   `optax.masked` / `optax.multi_transform` keep state for their own leaves only (`state_dims`);
5. one all-gather per dtype gives every device the whole new params.

A ring all-reduce is a reduce-scatter followed by an all-gather, so the traffic is the same:
2(N−1)/N · P bytes per device. Per device the optimizer state shrinks from S to S/N (the whole
leaves, and optimizer state leaves shaped unlike their param, such as adafactor's factored
moments, stay whole). Checkpoints (`canonical`) are the replicated layout's: the same shapes.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jdp.core.blockwise import WHOLE, blockwise
from jdp.core.layouts import ShardMapLayout, state_tree
from jdp.core.mesh import DATA_AXIS, replicated
from jdp.core.reduce import low_precision, reduce_step_values
from jdp.core.state import TrainState


def split_dim(shape, n: int) -> int:
    """The dimension a leaf of `shape` is split along over `n` devices: its largest one after the
    first that `n` divides (the first of equal ones), else the first if `n` divides it, or WHOLE (-1)
    if none does or n is 1. The first dimension comes last because stacked layers (a scanned
    model's leading axis of layers) lie along it: split there, a device would hold whole layers
    (a scanned model gathers such a leaf whole before its scan, `jdp.fsdp.gather_layer_axis`)."""
    dims = [i for i, s in enumerate(shape) if s and s % n == 0] if n > 1 else []
    later = [i for i in dims if i > 0]
    return max(later, key=lambda i: (shape[i], -i)) if later else dims[0] if dims else WHOLE


def spec(dim: int, ndim: int, axis: str) -> P:
    """The partition spec of a leaf split along `dim` (WHOLE: replicated)."""
    return P() if dim == WHOLE else P(*([None] * dim), axis, *([None] * (ndim - dim - 1)))


class Cuts:
    """How each params leaf lies on the n devices of mesh axis `axis`: split along `dims[i]` (see
    `split_dim`) or whole.

    Leaf i of `params` (canonical, global shapes) split along k has blocks of shape s with
    s[k] = shape[k] / n; device d holds indices [d·s[k], (d+1)·s[k]) of dimension k. Hybrid
    sharding: `replicas` groups of n devices along `replica_axis` each hold the leaf so split (a
    device's block is the same in every group), and a reduction over all n·replicas devices
    completes the groups' reduce-scatters with one all-reduce of the blocks across the groups.
    """

    def __init__(self, params, n: int, axis: str = DATA_AXIS, replica_axis: str | None = None, replicas: int = 1):
        self.n, self.axis, self.replica_axis, self.replicas = n, axis, replica_axis, replicas
        self.struct = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), params)
        self.leaves, self.treedef = jax.tree.flatten(self.struct)
        self.dims = [split_dim(x.shape, n) for x in self.leaves]

    def whole_leaves(self) -> list[tuple[str, int]]:
        """(path, bytes) of every leaf kept whole on each of the n devices (no dimension `split_dim`
        may split over n), largest first; empty for n = 1, where nothing is split."""
        if self.n == 1:
            return []
        # an nnx Variable's path ends in ".value": the name is the param's without it
        paths = [jax.tree_util.keystr(path).removesuffix(".value")
                 for path, _ in jax.tree_util.tree_flatten_with_path(self.struct)[0]]
        whole = [(paths[i], self.block_bytes(i)) for i, k in enumerate(self.dims) if k == WHOLE]
        return sorted(whole, key=lambda pb: -pb[1])

    def dim_tree(self):
        return self.treedef.unflatten(self.dims)

    def specs(self):
        return self.treedef.unflatten([spec(d, len(x.shape), self.axis) for d, x in zip(self.dims, self.leaves)])

    def block_bytes(self, i: int) -> int:
        """Bytes of one device's part of leaf i (its block, or the whole leaf)."""
        x = self.leaves[i]
        return int(np.prod(x.shape, dtype=np.int64)) * x.dtype.itemsize // (1 if self.dims[i] == WHOLE else self.n)

    def own(self, tree):
        """This device's block of every leaf of `tree` (whole leaves as they are; inside the mapped step)."""
        d = lax.axis_index(self.axis)
        leaves = self.treedef.flatten_up_to(tree)
        return self.treedef.unflatten([x if k == WHOLE else lax.dynamic_slice_in_dim(x, d * (x.shape[k] // self.n),
                                                                                     x.shape[k] // self.n, axis=k)
                                       for x, k in zip(leaves, self.dims)])

    def _rows(self, x, k):
        """Leaf `x` as N rows: row d is device d's block along dimension k, flattened."""
        return jnp.moveaxis(x, k, 0).reshape(self.n, -1)

    def _block(self, flat, i):
        """Leaf i's block from its flattened block."""
        shape = list(self.leaves[i].shape)
        k = self.dims[i]
        moved = [shape[k] // self.n] + shape[:k] + shape[k + 1:]
        return jnp.moveaxis(flat.reshape(moved), 0, k)

    def split(self, tree):
        """(indices of split leaves, of whole leaves) of `tree`'s leaves."""
        split = [i for i, k in enumerate(self.dims) if k != WHOLE]
        return split, [i for i, k in enumerate(self.dims) if k == WHOLE]

    def scatter(self, grads, mean: bool, reduce_dtype=None):
        """Reduce-scatter: this device's block of every split leaf, summed (mean: averaged) over
        all devices; whole leaves come back as None. One `psum_scatter` per dtype: the leaves laid
        out as an (n, Σ block sizes) buffer whose row d is what device d receives (hybrid: then one
        `psum` of the rows across the replica groups). bf16/fp16 are divided by the device count
        before the sum (it cannot overflow), float32 after it, as `mean_over_devices` does."""
        leaves = self.treedef.flatten_up_to(grads)
        own = [x.dtype for x in leaves]
        if reduce_dtype is not None:
            leaves = [x.astype(reduce_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x for x in leaves]
        out = [None] * len(leaves)
        split, _ = self.split(grads)
        for dtype in dict.fromkeys(leaves[i].dtype for i in split):
            idx = [i for i in split if leaves[i].dtype == dtype]
            buf = jnp.concatenate([self._rows(leaves[i], self.dims[i]) for i in idx], axis=1)
            before, total = mean and low_precision(buf), self.n * self.replicas
            buf = buf / total if before else buf
            row = lax.psum_scatter(buf.reshape(-1), self.axis, scatter_dimension=0, tiled=True)
            row = self.across_replicas(row)
            row = row / total if mean and not before else row
            sizes = [self.block_bytes(i) // self.leaves[i].dtype.itemsize for i in idx]
            for i, part in zip(idx, jnp.split(row, np.cumsum(sizes)[:-1])):
                out[i] = self._block(part, i).astype(own[i])
        return out

    def across_replicas(self, tree):
        """Hybrid sharding: `tree` (blocks reduced within each group) summed over the replica groups, one
        all-reduce; as it is otherwise."""
        return tree if self.replica_axis is None else lax.psum(tree, self.replica_axis)

    def gather(self, blocks):
        """All-gather: the whole leaves, in their shapes, from every device's blocks. One per dtype."""
        parts = self.treedef.flatten_up_to(blocks)
        out = list(parts)
        split, _ = self.split(blocks)
        for dtype in dict.fromkeys(parts[i].dtype for i in split):
            idx = [i for i in split if parts[i].dtype == dtype]
            flat = jnp.concatenate([jnp.moveaxis(parts[i], self.dims[i], 0).reshape(-1) for i in idx])
            rows = lax.all_gather(flat, self.axis, tiled=True).reshape(self.n, -1)
            sizes = [self.block_bytes(i) // self.leaves[i].dtype.itemsize for i in idx]
            for i, block in zip(idx, jnp.split(rows, np.cumsum(sizes)[:-1], axis=1)):
                shape = list(self.leaves[i].shape)
                k = self.dims[i]
                moved = block.reshape([shape[k]] + shape[:k] + shape[k + 1:])
                out[i] = jnp.moveaxis(moved, 0, k)
        return self.treedef.unflatten(out)

    def gather_leaf(self, x, i: int, dtype=None):
        """Leaf i whole from this device's block (one all-gather along its split dimension),
        travelling in `dtype` if given (a float32 leaf cast to the compute dtype first)."""
        x = x.astype(dtype) if dtype is not None and x.dtype == jnp.float32 else x
        return x if self.dims[i] == WHOLE else lax.all_gather(x, self.axis, axis=self.dims[i], tiled=True)


def state_owners(opt_struct, cuts: Cuts):
    """For every optimizer state leaf, the index (into `cuts.leaves`) of the param it is a copy of:
    the param of its shape at a path ending in the param's path (Adam's `.mu['l0']['w']` for
    `['l0']['w']`, the longest such param), else -1 (step counts, adafactor's factored moments,
    muon's coefficients).

    Read from the paths, not from `optax.tree_map_params`, whose params-shaped subtrees must match
    the params' whole structure: `optax.masked` and `optax.multi_transform` leave `optax.MaskedNode`
    (no leaves) where a param is not theirs.
    """
    paths = {tuple(path): i for i, (path, _) in enumerate(jax.tree_util.tree_flatten_with_path(cuts.struct)[0])}
    lengths = sorted({len(p) for p in paths}, reverse=True)

    def owner(path, x):
        for n in lengths:
            i = paths.get(tuple(path[len(path) - n:])) if n <= len(path) else None
            if i is not None and x.shape == cuts.leaves[i].shape:
                return i
        return -1

    return jax.tree_util.tree_map_with_path(owner, opt_struct)


def state_dims(opt_struct, cuts: Cuts):
    """The split dimension of every optimizer state leaf: its param's (`cuts.dims`, see
    `state_owners`), else WHOLE. The dimensions only place the state: `blockwise` runs the update
    exactly for any of them."""
    return jax.tree.map(lambda i: WHOLE if i < 0 else cuts.dims[i], state_owners(opt_struct, cuts))


def clip_by_global_norm(max_norm: float, axis: str = DATA_AXIS) -> optax.GradientTransformation:
    """`optax.clip_by_global_norm(max_norm)`: the sharded layouts run it as written, on the whole
    gradient's norm (`axis` is accepted for code written for jdp's earlier flat slices, and unused)."""
    del axis
    return optax.clip_by_global_norm(max_norm)


class ShardedStateLayout(ShardMapLayout):
    """`jax.shard_map` with the optimizer state sharded: params replicated, every optimizer state
    leaf shaped like its param split as that param is (`Cuts`), the others (step counts,
    factored moments) replicated. The shardings depend on the params' shapes: `bind(params)` sets
    them (`TrainStep.init` calls it).
    """

    def __init__(self, mesh, accum: str | None, optimizer: optax.GradientTransformation):
        super().__init__(mesh, accum)
        self.optimizer, self.cuts, self._device_step, self._jitted = optimizer, None, None, None
        self.gathered = []  # operations the optimizer's update ran on whole values (`jdp.core.blockwise`)
        # The state is split along the mesh's last axis: all of it, or (hybrid) a replica group's devices.
        self.shard_axis = mesh.axis_names[-1]
        self.replica_axis = mesh.axis_names[0] if len(mesh.axis_names) > 1 else None
        self.group = mesh.shape[self.shard_axis]  # devices one state leaf is split over
        self.replicas = self.num_devices // self.group

    def bind(self, params) -> bool:
        """Cut `params`' leaves over the devices; True if this changed the state's layout."""
        cuts = Cuts(params, self.group, self.shard_axis, self.replica_axis, self.replicas)
        if self.cuts is not None and (cuts.treedef, cuts.leaves) == (self.cuts.treedef, self.cuts.leaves):
            return False
        self.opt_struct = jax.eval_shape(self.optimizer.init, cuts.struct)
        self.opt_dims = state_dims(self.opt_struct, cuts)
        opt_specs = jax.tree.map(lambda d, x: spec(d, len(x.shape), self.shard_axis), self.opt_dims, self.opt_struct)
        self.cuts, self._jitted = cuts, None
        self._specs = self.state_specs(opt_specs)
        self.state_shardings = jax.tree.map(lambda s: NamedSharding(self.mesh, s), self._specs,
                                            is_leaf=lambda x: isinstance(x, P))
        return True

    def state_specs(self, opt_specs) -> TrainState:
        """The state's partition specs once the optimizer state's are known: params replicated."""
        return state_tree(P(), P(self.axis), self.accum).replace(opt_state=opt_specs)

    def per_device(self, params):
        return params  # check_vma=False (see `compile`): the gradient is this device's own already

    def step_optimizer(self, tx: optax.GradientTransformation) -> optax.GradientTransformation:
        """`tx` with its update run on this device's blocks, exactly as on whole arrays (`jdp.core.blockwise`)."""
        def update(grads, state, params=None, **extra):  # extra: MultiSteps' grad_scale (weighted losses)
            cuts = self.cuts
            run = functools.partial(tx.update, **extra) if extra else tx.update
            out, gathered = blockwise(run, (cuts.struct, self.opt_struct, cuts.struct), (grads, state, params),
                                      (cuts.dim_tree(), self.opt_dims, cuts.dim_tree()),
                                      (cuts.dim_tree(), self.opt_dims), self.shard_axis, self.group)
            self.gathered = gathered
            return out

        return optax.GradientTransformationExtraArgs(tx.init, update)

    def reduce(self, grads, means, o):
        """This device's block of the reduced gradient of every split leaf (one reduce-scatter per
        dtype), and the whole leaves' gradient with the means in one small all-reduce. Scales as
        `reduce_step_values`: "mean" averages, "sum" sums."""
        cuts = self.cuts
        blocks = cuts.scatter(grads, o.reduction == "mean", o.reduce_dtype)
        leaves = cuts.treedef.flatten_up_to(grads)
        _, whole = cuts.split(grads)
        small, means = reduce_step_values([leaves[i] for i in whole], means, o.reduction, o.reduce_dtype, self.axis)
        for i, g in zip(whole, small):
            blocks[i] = g
        return cuts.treedef.unflatten(blocks), means

    def own(self, params):
        return self.cuts.own(params)

    def gather(self, params):
        return self.cuts.gather(params)

    def everywhere(self, flag):
        """True on every device iff `flag` is True on all of them (one scalar all-reduce)."""
        return lax.psum(jnp.logical_not(flag).astype(jnp.int32), self.axis) == 0

    def global_norm(self, grads):
        """The whole gradient's L2 norm, float32: the blocks' squares summed over the devices a leaf
        is split over (one scalar all-reduce; hybrid: within a group, which holds every block once),
        the whole leaves' counted once."""
        leaves = self.cuts.treedef.flatten_up_to(grads)
        sq = lambda x: jnp.sum(jnp.square(x.astype(jnp.float32)))  # noqa: E731
        split, whole = self.cuts.split(grads)
        local = sum((sq(leaves[i]) for i in split), jnp.float32(0))
        return jnp.sqrt(lax.psum(local, self.shard_axis) + sum((sq(leaves[i]) for i in whole), jnp.float32(0)))

    def canonical(self, state: TrainState) -> TrainState:
        """The optimizer state as the replicated layout holds it (the same shapes, replicated)."""
        return state.replace(opt_state=jax.device_put(state.opt_state, replicated(self.mesh)))

    def compile(self, device_step):
        # check_vma=False: the all-gathered params are the same on every device, which the varying
        # types of jax 0.10's public `lax.all_gather` cannot state (its invariant form is private).
        # Every collective of this layout is explicit, so nothing relies on the types.
        self._device_step = device_step
        return _BoundStep(self)

    def jitted(self):
        if self.cuts is None:
            raise ValueError("the step's optimizer state is sharded by the params' shapes: make the state with "
                             "step.init(params) first.")
        if self._jitted is None:
            mapped = jax.shard_map(self._device_step, mesh=self.mesh, in_specs=(self._specs, P(self.axis)),
                                   out_specs=(self._specs, P()), check_vma=False)
            self._jitted = jax.jit(mapped, donate_argnums=0)
        return self._jitted


class _BoundStep:
    """The compiled step of a `ShardedStateLayout`, built once its shardings are known."""

    def __init__(self, layout: ShardedStateLayout):
        self.layout = layout

    def __call__(self, state, batch):
        return self.layout.jitted()(state, batch)

    def lower(self, state, batch):
        return self.layout.jitted().lower(state, batch)
