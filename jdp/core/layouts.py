"""Layouts: how the state and batch of a data-parallel step lie on the devices, one class per backend.

A layout owns everything the two backends do differently: the state's shardings and stacking, batch
placement, the per-device view of params and accumulator, donation, and how the compiled function
is built. The algorithm (`jdp.core.algorithm.device_step`) is the same for both.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from jdp.core.mesh import batch_sharded, data_axes, replicated
from jdp.core.reduce import reduce_step_values
from jdp.core.state import LocalAccum, TrainState

UNSIZED = None  # the aux part of an accumulator before the first call has shown aux's structure


ACCUMULATORS = (None, "per_device", "replicated")  # what a state's `accum` holds (see `TrainStep`)


def state_tree(value, accum, kind) -> TrainState:
    """A TrainState-shaped prefix tree: `value` for the replicated fields, `accum` for a per-device accumulator."""
    return TrainState(step=value, micro_step=value, params=value, opt_state=value, model_state=value, rng=value,
                      skipped=value, skip_streak=value, accum={None: None, "per_device": accum, "replicated": value}[kind])


class ShardMapLayout:
    """`jax.jit(jax.shard_map(...))` over a 1-D mesh: one global array per value.

    State leaves are replicated (`P()`), the batch is split along the mesh's axis, and a per-device
    accumulator is one (N, ...) array whose row d is device d's.
    """

    name = "shard_map"
    stacked = False
    global_view = False  # the loss sees one device's share of the batch (`jdp.core.global_view`: the whole)

    def __init__(self, mesh: Mesh, accum: str | None):
        self.mesh, self.num_devices, self.accum = mesh, mesh.devices.size, accum
        self.axis = data_axes(mesh)  # the axis (hybrid: the two axes) every all-device collective names
        self.state_shardings = state_tree(replicated(mesh), batch_sharded(mesh), accum)
        self._specs = state_tree(P(), P(self.axis), accum)

    @property
    def weight_devices(self) -> int:
        """The global weight over a reduced weight (a mean over the devices): N."""
        return self.num_devices

    def loss_shapes(self, loss, params, model_state, placed, part: int = 0):
        """The structure of `loss`'s aux (`part=1`: its new model state) on one device's share of `placed`."""
        return aux_shapes(loss, self.mesh, params, model_state, self.device_batch(placed), part)

    def per_device(self, params):
        # Replicated params are axis-invariant; differentiating w.r.t. them makes jax.grad sum the
        # gradient over devices itself (and pmean becomes the identity). Casting them to per-device
        # values outside the loss makes grad return this device's own gradient.
        return lax.pcast(params, self.axis, to="varying")

    def bind(self, params) -> bool:
        """Fit the layout to `params`' shapes; True if that changed `state_shardings` (never here)."""
        return False

    def step_optimizer(self, tx: optax.GradientTransformation) -> optax.GradientTransformation:
        """The transformation the algorithm calls on this layout's view of the gradient (here `tx` itself)."""
        return tx

    # The optimizer's view (see `jdp.core.algorithm.reduce_and_update`): here every device reduces the
    # whole gradient and updates all the params; `jdp.zero.ShardedStateLayout` slices them.
    def reduce(self, grads, means, o):
        """`(grads, means)` reduced in one all-reduce: `reduce_step_values`' scales."""
        return reduce_step_values(grads, means, o.reduction, o.reduce_dtype, self.axis)

    def _as_is(self, value):
        """`value` unchanged: in this layout every device holds it whole already."""
        return value

    own = gather = _as_is  # the params are replicated: each device owns and sees all of them

    def everywhere(self, flag):
        """A replicated bool is already the same on every device."""
        return flag

    def without_padding(self, grads, params, opt_state):
        """The step's values with any padding the layout added zeroed (none here)."""
        return grads, params, opt_state

    def global_norm(self, grads):
        """The whole gradient's L2 norm, in float32 (squaring fp16 overflows long before the values do)."""
        return optax.tree.norm(jax.tree.map(lambda g: g.astype(jnp.float32), grads))

    def local(self, accum):
        """This device's accumulator from its (1, ...) block of the (N, ...) one."""
        return jax.tree.map(lambda x: x[0], accum)

    def shared(self, accum):
        return jax.tree.map(lambda x: x[None], accum)

    def spread(self, state: TrainState) -> TrainState:
        """The layout of a one-copy state without accumulator (inside jit; `state_shardings` place it)."""
        return state

    def empty_accum(self, params, aux) -> LocalAccum | None:
        """A zero accumulator in this layout (inside jit; `state_shardings.accum` places it).

        "per_device" (accum_sync="last"): one row per device of gradient, loss, aux and weight
        sums; "replicated" ("every"): one copy of the loss, aux and weight sums. `aux` may be UNSIZED.
        """
        f32 = jax.ShapeDtypeStruct((), jnp.float32)
        if self.accum == "per_device":
            rows = lambda tree: jax.tree.map(lambda x: jnp.zeros((self.num_devices, *jnp.shape(x)), x.dtype), tree)  # noqa: E731
            return LocalAccum(rows(params), rows(f32), rows(aux), rows(f32))
        if self.accum == "replicated":
            zeros = lambda tree: jax.tree.map(lambda x: jnp.zeros(jnp.shape(x), x.dtype), tree)  # noqa: E731
            return self._copies(LocalAccum(None, zeros(f32), zeros(aux), zeros(f32)))
        return None

    def _copies(self, tree):
        return tree

    def canonical(self, state: TrainState) -> TrainState:
        return state

    def place_batch(self, batch, num_local: int):
        return jax.device_put(batch, batch_sharded(self.mesh))

    def device_batch(self, placed):
        """One device's batch shapes, from a placed batch."""
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct((x.shape[0] // self.num_devices, *x.shape[1:]), x.dtype),
                            placed)

    def compile(self, device_step):
        mapped = jax.shard_map(device_step, mesh=self.mesh, in_specs=(self._specs, P(self.axis)),
                               out_specs=(self._specs, P()), check_vma=True)
        return jax.jit(mapped, donate_argnums=0)


class PmapLayout(ShardMapLayout):
    """`jax.pmap(...)`: every state leaf carries a leading device axis of size N (one copy each),
    and the batch is reshaped to (N, b, ...).

    Every argument is mapped on axis 0: `in_axes=None` on an empty pytree (e.g. `optax.sgd`'s
    state) shifts the axes of the next argument's leaves in jax 0.10.2.
    """

    name = "pmap"
    stacked = True

    def __init__(self, mesh: Mesh, accum: str | None):
        super().__init__(mesh, accum)
        self.state_shardings = state_tree(batch_sharded(mesh), batch_sharded(mesh), accum).replace(stacked=True)

    per_device = local = shared = ShardMapLayout._as_is  # pmap hands each device its own slice already

    def spread(self, state: TrainState) -> TrainState:
        return self._copies(state).replace(stacked=True)

    def _copies(self, tree):
        return jax.tree.map(lambda x: jnp.broadcast_to(x, (self.num_devices, *x.shape)), tree)

    def canonical(self, state: TrainState) -> TrainState:
        return jax.tree.map(lambda x: x[0], state).replace(stacked=False)

    def place_batch(self, batch, num_local: int):
        batch = jax.tree.map(lambda x: np.reshape(x, (num_local, np.shape(x)[0] // num_local, *np.shape(x)[1:])),
                             batch)
        return jax.device_put(batch, batch_sharded(self.mesh))

    def device_batch(self, placed):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), placed)

    def compile(self, device_step):
        # Metrics are reduced values, equal on every device: out_axes=None returns them once
        # instead of stacked (no per-call slicing). On CPU the state is not donated: jax.pmap
        # (jit of shard_map) squeezes the device axis, and with the state aliased in place XLA
        # copies every optimizer moment in and every param out (20 more copies for the benchmark
        # MLP on 2 devices, +32% step time); fresh output buffers need the same peak memory.
        devices = list(self.mesh.devices.flat)
        on_cpu = all(d.platform == "cpu" for d in devices)
        return jax.pmap(device_step, axis_name=self.axis, devices=devices, out_axes=(0, None),
                        donate_argnums=() if on_cpu else 0)


LAYOUTS = {"shard_map": ShardMapLayout, "pmap": PmapLayout}


def aux_shapes(loss, mesh: Mesh, params, model_state, device_batch, part: int = 0):
    """The structure of `loss`'s aux (`part=1`: its new model state) for one device's batch shapes,
    traced on the mesh (so that collectives inside the loss, e.g. synchronised BatchNorm, have their axis)."""
    n = mesh.devices.size
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct((x.shape[0] * n, *x.shape[1:]), x.dtype), device_batch)
    traced = jax.shard_map(loss, mesh=mesh, in_specs=(P(), P(), P(data_axes(mesh)), P()), out_specs=P(),
                           check_vma=False)
    return jax.eval_shape(traced, params, model_state, batch, jax.ShapeDtypeStruct((2,), jnp.uint32))[1][part]
