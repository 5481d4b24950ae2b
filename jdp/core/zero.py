"""The optimizer state sharded over the data-parallel devices (ZeRO stage 1), the same step.

Data parallelism replicates params, gradient and optimizer state on every device; for Adam in
float32 that is 16 bytes per parameter (params 4, gradient 4, moments 8). `ShardedStateLayout`
keeps one N-th of the optimizer state on each device:

1. every device computes its mean gradient over its b examples (the whole gradient, as before);
2. one reduce-scatter (`lax.psum_scatter`, with the mean's 1/N) leaves device d the global-mean
   gradient of slice d of every leaf (each leaf flattened and padded with zeros to a multiple of N);
3. the optimizer updates slice d of the params with slice d of its state;
4. one all-gather gives every device the whole new params.

A ring all-reduce is a reduce-scatter followed by an all-gather, so the traffic is the same:
2(N−1)/N · P bytes per device. Per device the optimizer state shrinks from S to S/N (plus padding).

The optimizer must update each element from its own gradient element (SGD, momentum, Adam, AdamW,
schedules, weight decay): `check_elementwise` proves it on probe values, or names the part that is
not. Global-norm clipping is not elementwise; `clip_by_global_norm` computes the norm from the
slices with one small all-reduce (what `OptimizerSpec(clip_norm=...)` builds when sharded).

Padding slots hold zeros in the params, the gradient and the state; the all-gather and `canonical`
drop them, and `skip_nonfinite` does not look at them (Adam with ε = 0 makes 0/0 there).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jdp.core.layouts import ShardMapLayout, state_tree
from jdp.core.mesh import DATA_AXIS, replicated
from jdp.core.reduce import low_precision, mean_over_devices
from jdp.core.state import TrainState


class Slices:
    """How each params leaf is cut into N equal slices: flattened, zero-padded to a multiple of N.

    Leaf i of `params` (canonical, global shapes) with s_i elements is padded to L_i = N·c_i,
    c_i = ceil(s_i / N), and device d holds elements [d·c_i, (d+1)·c_i) of it.
    """

    def __init__(self, params, n: int, axis: str = DATA_AXIS):
        self.n, self.axis = n, axis
        self.struct = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), params)
        self.leaves, self.treedef = jax.tree.flatten(self.struct)
        self.sizes = [int(np.prod(x.shape, dtype=np.int64)) for x in self.leaves]
        self.chunks = [max(1, -(-size // n)) for size in self.sizes]

    def padded(self, x, c: int):
        """A leaf flattened and zero-padded to N·c elements."""
        flat = jnp.ravel(x)
        return jnp.pad(flat, (0, self.n * c - flat.size))

    def flat_struct(self):
        """The params as the optimizer state sees them when sharded: one (N·c_i,) vector per leaf."""
        return self.treedef.unflatten([jax.ShapeDtypeStruct((self.n * c,), x.dtype)
                                       for x, c in zip(self.leaves, self.chunks)])

    def own(self, tree):
        """This device's (c_i,) slice of every leaf (inside the mapped step)."""
        d = lax.axis_index(self.axis)
        leaves = self.treedef.flatten_up_to(tree)
        return self.treedef.unflatten([lax.dynamic_slice_in_dim(self.padded(x, c), d * c, c)
                                       for x, c in zip(leaves, self.chunks)])

    def scatter(self, grads, mean: bool, reduce_dtype=None):
        """Reduce-scatter: this device's slice of the gradient summed (mean: averaged) over devices.

        One `psum_scatter` per dtype: the leaves are laid out as an (N, Σc_i) buffer whose row d is
        slice d of every leaf, so row d is what device d receives. bf16/fp16 are divided by N
        before the sum (it cannot overflow), float32 after it, as `mean_over_devices` does.
        """
        leaves = self.treedef.flatten_up_to(grads)
        own = [x.dtype for x in leaves]
        if reduce_dtype is not None:
            leaves = [x.astype(reduce_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x for x in leaves]
        out = [None] * len(leaves)
        for dtype in dict.fromkeys(x.dtype for x in leaves):
            idx = [i for i, x in enumerate(leaves) if x.dtype == dtype]
            buf = jnp.concatenate([self.padded(leaves[i], self.chunks[i]).reshape(self.n, -1) for i in idx], axis=1)
            before = mean and low_precision(buf)
            buf = buf / self.n if before else buf
            row = lax.psum_scatter(buf.reshape(-1), self.axis, scatter_dimension=0, tiled=True)
            row = row / self.n if mean and not before else row
            for i, part in zip(idx, jnp.split(row, np.cumsum([self.chunks[i] for i in idx])[:-1])):
                out[i] = part.astype(own[i])
        return self.treedef.unflatten(out)

    def gather(self, slices):
        """All-gather: the whole leaves, in their shapes, from every device's slices. One per dtype."""
        parts = self.treedef.flatten_up_to(slices)
        out = [None] * len(parts)
        for dtype in dict.fromkeys(x.dtype for x in parts):
            idx = [i for i, x in enumerate(parts) if x.dtype == dtype]
            rows = lax.all_gather(jnp.concatenate([parts[i] for i in idx]), self.axis, tiled=True).reshape(self.n, -1)
            cols = jnp.split(rows, np.cumsum([self.chunks[i] for i in idx])[:-1], axis=1)
            for i, block in zip(idx, cols):
                out[i] = block.reshape(-1)[:self.sizes[i]].reshape(self.leaves[i].shape)
        return self.treedef.unflatten(out)

    def real(self, x, c: int, leaf):
        """This device's (c,) slice `x` of `leaf` with its padding slots zeroed (inside the mapped step)."""
        index = lax.axis_index(self.axis) * c + jnp.arange(c)
        return jnp.where(index < leaf.size, x, jnp.zeros_like(x))

    def chunk_tree(self):
        return self.treedef.unflatten(self.chunks)


def squared_norm_everywhere(tree, axis: str = DATA_AXIS) -> jax.Array:
    """Σ x² over this device's slices of `tree`, summed over the devices: one scalar all-reduce."""
    local = sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree))
    return lax.psum(local, axis)


def clip_by_global_norm(max_norm: float, axis: str = DATA_AXIS) -> optax.GradientTransformation:
    """`optax.clip_by_global_norm` for a gradient sharded over `axis`: the same rule, with the
    norm of the whole gradient (from every device's slices, one scalar all-reduce)."""

    def update(updates, state, params=None):
        del params
        norm = jnp.sqrt(squared_norm_everywhere(updates, axis))
        clip = lambda t: lax.select(norm < max_norm, t, (t / norm.astype(t.dtype)) * max_norm)  # noqa: E731
        return jax.tree.map(clip, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


class ShardedStateLayout(ShardMapLayout):
    """`jax.shard_map` with the optimizer state sharded: params replicated, every param-shaped leaf
    of the optimizer state one (N·c_i,) global array split along `DATA_AXIS` (device d holds
    slice d), its scalars (step counts) replicated. The shardings depend on the params' shapes:
    `bind(params)` sets them (`TrainStep.init` calls it).
    """

    def __init__(self, mesh, accum: str | None, optimizer: optax.GradientTransformation):
        super().__init__(mesh, accum)
        self.optimizer, self.slices, self._device_step, self._jitted = optimizer, None, None, None

    def bind(self, params) -> bool:
        """Cut `params`' leaves over the devices; True if this changed the state's layout."""
        slices = Slices(params, self.num_devices, self.axis)
        if self.slices is not None and (slices.treedef, slices.leaves) == (self.slices.treedef, self.slices.leaves):
            return False
        opt = jax.eval_shape(self.optimizer.init, slices.flat_struct())
        specs = optax.tree_map_params(self.optimizer, lambda _: P(self.axis), opt, transform_non_params=lambda _: P())
        self.slices, self._jitted = slices, None
        self._specs = self.state_specs(specs)
        self.state_shardings = jax.tree.map(lambda spec: NamedSharding(self.mesh, spec), self._specs,
                                            is_leaf=lambda x: isinstance(x, P))
        return True

    def state_specs(self, opt_specs) -> TrainState:
        """The state's partition specs once the optimizer state's are known: params replicated."""
        return state_tree(P(), P(self.axis), self.accum).replace(opt_state=opt_specs)

    def per_device(self, params):
        return params  # check_vma=False (see `compile`): the gradient is this device's own already

    def reduce(self, grads, means, o):
        """This device's slice of the reduced gradient (one reduce-scatter), and the means (one
        small all-reduce). Scales as `reduce_step_values`: "mean" averages, "sum" sums."""
        return self.slices.scatter(grads, o.reduction == "mean", o.reduce_dtype), mean_over_devices(means, self.axis)

    def own(self, params):
        return self.slices.own(params)

    def gather(self, params):
        return self.slices.gather(params)

    def everywhere(self, flag):
        """True on every device iff `flag` is True on all of them (one scalar all-reduce)."""
        return lax.psum(jnp.logical_not(flag).astype(jnp.int32), self.axis) == 0

    def global_norm(self, grads):
        return jnp.sqrt(squared_norm_everywhere(grads, self.axis))

    def without_padding(self, grads, params, opt_state):
        """Padding slots zeroed: an optimizer may turn their zero gradient into a NaN (Adam with
        ε = 0: 0/0) that no element of the replicated step has."""
        chunks, struct, real = self.slices.chunk_tree(), self.slices.struct, self.slices.real
        return (jax.tree.map(real, grads, chunks, struct), jax.tree.map(real, params, chunks, struct),
                optax.tree_map_params(self.optimizer, real, opt_state, chunks, struct))

    def spread(self, state: TrainState) -> TrainState:
        """The canonical optimizer state, each param-shaped leaf flattened and padded (inside jit)."""
        opt = optax.tree_map_params(self.optimizer, self.slices.padded, state.opt_state, self.slices.chunk_tree())
        return state.replace(opt_state=opt)

    def canonical(self, state: TrainState) -> TrainState:
        """The optimizer state as the replicated layout holds it: padding dropped, leaves reshaped."""
        def unpad(x, leaf):  # replicated again, as the replicated layout holds it
            return jax.device_put(x[:leaf.size].reshape(leaf.shape), replicated(self.mesh))

        return state.replace(opt_state=optax.tree_map_params(self.optimizer, unpad, state.opt_state,
                                                             self.slices.struct))

    def compile(self, device_step):
        # check_vma=False: the all-gathered params are the same on every device, which the varying
        # types of jax 0.10's public `lax.all_gather` cannot state (its invariant form is private).
        # Every collective of this layout is explicit, so nothing relies on the types.
        self._device_step = device_step
        return _BoundStep(self)

    def jitted(self):
        if self.slices is None:
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


_PROBE_DEVICES = 3  # slices of 5, 12 and 1 elements: none divides evenly, so padding is probed too
_PROBE_SCALES = (1e-3, 1.0, 1e8)  # gradient sizes of the probe's steps: 1e8 engages any clipping threshold


def _probe_elementwise(tx: optax.GradientTransformation, axis: str = DATA_AXIS) -> bool:
    """Whether three updates of `tx` on N slices of a gradient equal the slices of its updates on the
    whole gradient (to float32 rounding). Both run under `jax.vmap` over `axis`, so a part
    that reduces over the devices (this module's `clip_by_global_norm`) sees its axis."""
    rng = np.random.default_rng(0)
    params = {"a": rng.normal(size=(5,)), "b": rng.normal(size=(3, 4)), "c": rng.normal(size=())}
    params = jax.tree.map(lambda x: np.asarray(x, np.float32), params)
    grads = [jax.tree.map(lambda x, s=s: (s * rng.normal(size=np.shape(x))).astype(np.float32), params)
             for s in _PROBE_SCALES]
    slices = Slices(params, _PROBE_DEVICES)

    def train(p, gs):
        state, steps = tx.init(p), []
        for g in gs:
            updates, state = tx.update(g, state, p)
            p = optax.apply_updates(p, updates)
            steps.append(updates)
        return steps

    run = jax.jit(jax.vmap(train, axis_name=axis))
    cut = lambda tree: jax.tree.map(lambda x, c: slices.padded(x, c).reshape(_PROBE_DEVICES, c), tree,  # noqa: E731
                                    slices.chunk_tree())
    try:
        whole = run(jax.tree.map(lambda x: x[None], params), [jax.tree.map(lambda x: x[None], g) for g in grads])
        parts = run(cut(params), [cut(g) for g in grads])
    except Exception:  # noqa: BLE001 - a transformation that cannot run on slices is not elementwise
        return False
    for w, p in zip(whole, parts):  # each step's updates, compared at that step's own scale
        rebuilt = [np.asarray(x).reshape(-1)[:leaf.size].reshape(leaf.shape)
                   for x, leaf in zip(jax.tree.leaves(p), jax.tree.leaves(params))]
        w = [np.asarray(x)[0] for x in jax.tree.leaves(w)]
        scale = max(float(np.abs(x).max()) for x in w)
        if not all(np.allclose(a, b, rtol=1e-5, atol=1e-6 * scale) for a, b in zip(w, rebuilt)):
            return False
    return True


def _parts(tx: optax.GradientTransformation) -> list[optax.GradientTransformation]:
    """The transformations `tx` is made of, as far as its closures show (optax.chain keeps tuples of
    init and update functions; wrappers keep the transformation itself)."""
    cells = lambda fn: [c.cell_contents for c in (getattr(fn, "__closure__", None) or ())]  # noqa: E731
    inits, updates = cells(tx.init), cells(tx.update)
    found = [v for v in inits + updates if isinstance(v, optax.GradientTransformation)]
    fns = lambda vs: [v for v in vs if isinstance(v, tuple) and v and all(callable(f) for f in v)]  # noqa: E731
    if len(fns(inits)) == 1 and len(fns(updates)) == 1 and len(fns(inits)[0]) == len(fns(updates)[0]):
        found += [optax.GradientTransformation(i, u) for i, u in zip(fns(inits)[0], fns(updates)[0])]
    return found


def _name(tx: optax.GradientTransformation) -> str:
    name = getattr(tx.update, "__qualname__", type(tx).__name__).split(".<locals>")[0]
    if name == "with_extra_args_support" and _parts(tx):
        return _name(_parts(tx)[0])
    return f"optax.{name}" if hasattr(optax, name) else name


def check_elementwise(tx: optax.GradientTransformation, axis: str = DATA_AXIS,
                      option: str = "shard_optimizer_state") -> None:
    """Refuse, in one sentence naming its part, an optimizer whose update of a slice of the gradient
    is not that slice of its update: a sharded optimizer state would change its step. `option`
    names the step option that shards it (shard_optimizer_state, or shard_params)."""
    if _probe_elementwise(tx, axis):
        return
    culprit = tx
    while True:
        failing = [part for part in _parts(culprit) if not _probe_elementwise(part, axis)]
        if not failing:
            break
        culprit = failing[0]
    raise ValueError(f"{option}=True needs an optimizer that updates each parameter element from "
                     f"its own gradient element, and {_name(culprit)} does not (its update of a slice of the "
                     f"gradient differs from that slice of its update), so the sharded step would differ from "
                     f"the replicated one; clip with jdp.OptimizerSpec(clip_norm=...) or "
                     f"jdp.zero.clip_by_global_norm, which see the whole gradient.")
