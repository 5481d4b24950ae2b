"""The global view: `jax.jit` over global arrays on the mesh, the reduction left to XLA's partitioner.

`backend="jit"` runs the same algorithm (`jdp.core.algorithm.device_step`: grad -> reduce ->
accumulate -> update) once, on the GLOBAL micro-batch, as code written for `jax.jit` over a mesh
does (Flax's NNX language model example, MaxText, Levanter). The loss sees all N·b rows of a call,
so a per-token mean over the whole batch (the summed token loss divided by the batch's real tokens)
is exact with no `jdp.Weighted`. Where the values lie is said with `NamedSharding`s:

- the batch: split along its first axis over every device (hybrid: over both mesh axes; on a
  caller's mesh, `make_train_step(mesh=...)`, over its batch axis: `jdp.core.mesh.users_mesh`);
- the state: replicated; with `shard_optimizer_state` (ZeRO-1) every optimizer state leaf shaped
  like its param split along that param's `jdp.core.zero.split_dim`; with `shard_params` (FSDP)
  the params so split too; with `replicas` > 1 split over the "shard" axis only;
- the residual stream of jdp's own models: pinned batch-sharded (`pin_batch`), as MaxText pins its
  activations; without the pin the partitioner carries the params' split into the activations.

The reduction is the identity here: the loss and its gradient are already those of the whole
batch, and the partitioner inserts the all-reduce (or, for split params, the gathers and
reductions) where the backward pass makes each gradient. What that rules out, refused by
`StepOptions`: reduction="sum" and lr_correction (a per-device sum has no meaning on one global
value), accum_sync="last" (the partitioner all-reduces every call's gradient), reduce_dtype (the
all-reduce happens inside the backward pass, in the dtype the gradient is computed in),
gather_in_model (the partitioner gathers), sync_batchnorm=False (there are no per-device
statistics). Dropout keys are functions of (seed, micro-step) only: one key for the global batch,
so the masks are one device's.
"""
from __future__ import annotations

import contextvars
import re

import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jdp.core.annotations import explicit_axes, mapped_specs, say_once
from jdp.core.layouts import ShardMapLayout, state_tree
from jdp.core.mesh import data_axes, replicated
from jdp.core.state import TrainState
from jdp.core.zero import Cuts, spec, state_owners

_PIN = contextvars.ContextVar("jdp_pin_batch", default=None)  # the batch sharding while a jit step is traced


def pin_batch(x: jax.Array) -> jax.Array:
    """`x` (batch, ...) constrained to lie split along its first axis over the step's devices, while a
    `backend="jit"` step is being traced; `x` itself everywhere else (shard_map, pmap, plain calls).

    jdp's models call it on the residual stream after the embedding and after every block.
    """
    sharding = _PIN.get()
    return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)


class JitLayout(ShardMapLayout):
    """`jax.jit` with `in_shardings`/`out_shardings` on global arrays: one program, partitioned by XLA.

    `shard` is None (replicated state), "optimizer" (ZeRO-1) or "params" (FSDP: params and
    optimizer state split). The shardings of a sharded layout depend on the params' shapes:
    `bind(params)` sets them (`TrainStep.init` calls it).
    """

    name = "jit"
    global_view = True  # the loss sees the global batch: its values need no reduction over devices
    weight_devices = 1  # a reduced weight is the global weight already (shard_map: N × the mean)

    def __init__(self, mesh, accum: str | None, optimizer: optax.GradientTransformation, shard: str | None = None,
                 data_axis: str | None = None):
        super().__init__(mesh, accum)
        self.axis = None  # no axis is bound inside the step: nothing in it may name one
        self.optimizer, self.shard, self.cuts, self._device_step, self._jitted = optimizer, shard, None, None, None
        # the batch's axes: jdp's mesh's (all of them), or on a caller's mesh (`users_mesh`) its batch axis
        self.data_axes = data_axes(mesh) if data_axis is None else data_axis
        self.batch = NamedSharding(mesh, P(self.data_axes))
        # the state is split along jdp's mesh's last axis (hybrid: "shard"), or a caller's mesh's batch axis
        self.shard_axis = mesh.axis_names[-1] if data_axis is None else data_axis
        self.group = mesh.shape[self.shard_axis]
        self.annotations, self.rules = None, {}  # the params' own sharding annotations (`annotate`)
        self.explicit = explicit_axes(mesh)  # a caller's mesh with Explicit axes: the annotations are types

    def annotate(self, annotations, rules: dict) -> None:
        """Lay the params out as their sharding annotations say, mapped by `rules` (`jdp.core.annotations`)."""
        self.annotations, self.rules, self.cuts = annotations, dict(rules), None

    def per_device(self, params):
        return params  # the whole params, global: the gradient is the global batch's

    def reduce(self, grads, means, o):
        """`(grads, means)` as they are: the global batch's already (the partitioner all-reduced them)."""
        return grads, means

    def local(self, accum):
        return accum

    shared = local

    def device_batch(self, placed):
        """What the loss sees: the global batch's shapes."""
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), placed)

    def loss_shapes(self, loss, params, model_state, placed, part: int = 0):
        """The structure of `loss`'s aux (`part=1`: its new model state) on the global batch."""
        return jax.eval_shape(loss, params, model_state, self.device_batch(placed),
                              jax.ShapeDtypeStruct((2,), jax.numpy.uint32))[1][part]

    def bind(self, params) -> bool:
        """Split the state's leaves for `params`' shapes (sharded layouts); True if the shardings changed."""
        if self.shard is None and self.annotations is None:
            return False
        cuts = Cuts(params, self.group, self.shard_axis)
        if self.cuts is not None and (cuts.treedef, cuts.leaves) == (self.cuts.treedef, self.cuts.leaves):
            return False
        if self.annotations is not None:
            param_specs, lacking = mapped_specs(params, self.annotations, self.rules, self.mesh,
                                                self.shard == "params", self.shard_axis, self.explicit)
            if lacking:
                say_once(f"backend='jit' replicates the params' annotated axes {', '.join(map(repr, lacking))}, which "
                         f"its mesh {dict(self.mesh.shape)} lacks; axis_rules={{{lacking[0]!r}: "
                         f"{self.shard_axis!r}}} would split along one.")
            if self.explicit and self.shard is not None:
                say_once(f"on the mesh {dict(self.mesh.shape)}, whose Explicit axes make a sharding part of an "
                         f"array's type, the params and their optimizer state lie as the annotations say (their "
                         f"split over {self.shard_axis!r} is the FSDP): shard_params and shard_optimizer_state "
                         f"add no split of their own, which would change the types the model is written for.")
        else:
            param_specs = cuts.specs() if self.shard == "params" else jax.tree.map(lambda _: P(), params)
        split = cuts.treedef.flatten_up_to(param_specs)
        opt_struct = jax.eval_shape(self.optimizer.init, cuts.struct)

        def opt_spec(i, x):  # an optimizer state leaf that copies a param's shape lies as that param does
            if i < 0:
                return P()
            if any(a is not None for a in split[i]) or self.shard is None or self.explicit:
                return split[i]  # Explicit axes: the update mixes it with the param, whose type it must share
            return spec(cuts.dims[i], len(x.shape), self.shard_axis)  # ZeRO-1: split though the param is whole

        # by the state's paths: optax.masked / multi_transform leave MaskedNode where a param is not theirs
        opt_specs = jax.tree.map(opt_spec, state_owners(opt_struct, cuts), opt_struct)
        specs = state_tree(P(), P(), self.accum).replace(opt_state=opt_specs, params=param_specs)
        self.cuts, self._jitted = cuts, None
        self.state_shardings = jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs,
                                            is_leaf=lambda x: isinstance(x, P))
        return True

    def canonical(self, state: TrainState) -> TrainState:
        """Params and optimizer state whole and replicated, as the replicated layouts hold them."""
        if self.shard is None and self.annotations is None:
            return state
        return state.replace(params=jax.device_put(state.params, replicated(self.mesh)),
                             opt_state=jax.device_put(state.opt_state, replicated(self.mesh)))

    def place_batch(self, batch, num_local: int):
        return jax.device_put(batch, self.batch)

    def compile(self, device_step):
        self._device_step = device_step
        return _BoundStep(self)

    def jitted(self):
        if (self.shard is not None or self.annotations is not None) and self.cuts is None:
            raise ValueError("the step's state is sharded by the params' shapes: make the state with "
                             "step.init(params) first.")
        if self._jitted is None:
            pin, step = self.batch, self._device_step

            def traced(state, batch):
                token = _PIN.set(pin)
                try:
                    return step(state, batch)
                finally:
                    _PIN.reset(token)

            self._jitted = jax.jit(traced, in_shardings=(self.state_shardings, self.batch),
                                   out_shardings=(self.state_shardings, replicated(self.mesh)), donate_argnums=0)
        return self._jitted


class _BoundStep:
    """The compiled step of a `JitLayout`, built once its shardings are known."""

    def __init__(self, layout: JitLayout):
        self.layout = layout

    def __call__(self, state, batch):
        try:
            return self.layout.jitted()(state, batch)
        except ValueError as e:  # the model's own code names an axis of the mesh it was written for
            found = re.match(r"Resource axis: (\w+) of .* is not found in mesh", str(e))
            if found is None or found.group(1) in self.layout.mesh.axis_names:
                raise
            raise ValueError(f"the model names the mesh axis {found.group(1)!r}, which the step's mesh "
                             f"{dict(self.layout.mesh.shape)} lacks; run the step on the mesh the model was "
                             f"written for with make_train_step(..., backend='jit', mesh=that_mesh).") from e

    def lower(self, state, batch):
        return self.layout.jitted().lower(state, batch)
