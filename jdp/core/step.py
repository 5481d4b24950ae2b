"""`make_train_step`: a data-parallel step on N devices that equals one device on the global batch.

Three parts, each in its own module: the options (`jdp.core.options.StepOptions`, every rule about
them), the per-device algorithm (`jdp.core.algorithm.device_step`: grad -> reduce -> accumulate ->
update), and the layout that runs it (`jdp.core.layouts`: shard_map or pmap;
`jdp.core.global_view`: jit, on the global batch). `TrainStep` joins them
and does the host side: the initial state, placing batches (`jdp.core.placement`), bounding how far
the host runs ahead.

The options of `make_train_step` that need more than a line:

`lr_correction`: only with reduction="sum". "auto" (the default there) scales every update by 1/N,
i.e. lr/N: exact for SGD/momentum, not for Adam (ε) or clipping. "none" keeps the raw sum. "exact"
(needs an OptimizerSpec) changes the spec's scale-dependent hyperparameters instead
(`jdp.exact_sum_spec`), which makes sum equal mean for every spec.

`mask_key`: the name of a batch entry of 1/0 weights marking real/padded examples, for a loss that
returns `sum(mask · per-example loss) / b`: jdp then divides by the real count, so that loss,
gradient and aux are means over the real examples only, in every accumulation mode. It is the
per-example case of a weighted loss (`jdp.Weighted(sum(mask · l), sum(mask))`, which carries its
weight itself and needs no mask_key). "auto" (the default) changes nothing, but refuses a plain mean
loss beside a batch entry named "mask" (is the loss already divided by it?); None changes nothing.

Weighted losses: loss_fn may return `jdp.Weighted(total, weight)`, the sum of its per-token (or
per-example) losses over this device's examples and the sum of their weights (e.g. the count of
real tokens). jdp sums both over the N devices and the M micro-batches of the optimizer step and
divides once: the gradient and `loss` are those of the mean over every real token of the global
batch, in every backend, accumulation mode and layout. Plain aux scalars are read as means over the
same weight; aux values may be `jdp.Weighted` with weights of their own. `metrics["weight"]` is the
global weight (the step's token count).

`skip_nonfinite`: an optimizer step whose reduced gradient (with accum_steps > 1: the mean of its M
micro-gradients), or the params or optimizer state it would produce, holds a NaN/Inf is skipped on
every device (params and optimizer state unchanged); `state.skipped` counts them,
`state.skip_streak` counts consecutive ones, and metrics report `skipped`.

`precision`: "float32" or "bfloat16" ("fp32"/"bf16", or the jnp dtypes): with bfloat16, loss_fn runs
on bf16 copies of the params and of the batch's float leaves (not the mask), so its forward and
backward compute in bf16, while the params (master weights), optimizer and model state, the gradient
reaching the optimizer, the loss and aux stay float32. Compute softmax and cross-entropy on float32
logits (jdp's models return them). float16 is refused: it needs loss scaling.

`reduce_dtype`: the dtype the gradient is all-reduced in; None (default) keeps the gradient's own.
"bfloat16" halves the all-reduce's bytes (each device divides by N before the sum, so it cannot
overflow; the mean is cast back to float32 for the optimizer) at the cost of rounding the gradient
to bf16 (`jdp explain` measures it).

`shard_optimizer_state`: ZeRO stage 1 (shard_map or jit): each device keeps 1/N of the optimizer state
(params stay replicated); the gradient is reduce-scattered, each device updates its slice of the
params, and an all-gather gives every device the whole new params: the same ring traffic as the all-
reduce, the same step (`jdp.zero`). The optimizer must be elementwise (checked; global-norm clipping
through `OptimizerSpec(clip_norm=...)` is exact). Checkpoints (`canonical`) are the same as the
replicated layout's.

`shard_params`: fully sharded data parallel (ZeRO-3; shard_map or jit; implies shard_optimizer_state):
between steps each device keeps 1/N of every params leaf too. Each call all-gathers the params (one
all-gather per leaf) for the forward and backward pass, reduce-scatters the gradient and updates
this device's slice (`jdp.fsdp`): the same ring traffic as the all-reduce per call, the same step.
`jdp.get_params(state)` and `canonical` give the params whole, in their shapes; checkpoints are the
replicated ones.

`axis_name`: the name of the mesh axis the step binds and reduces over (default "data"). Code that
already reduces over its own axis, e.g. Flax's examples with `nn.BatchNorm(axis_name= 'batch')` or
`lax.pmean(x, 'batch')` inside the loss, runs unchanged with `axis_name='batch'`; a loss that
reduces over an axis the step does not bind is refused, naming both.

`sync_batchnorm`: has_state only. True (default): the new model state must come out of the loss the
same on every device (synchronised BatchNorm); the first call checks it and refuses per-device
statistics, naming the leaf. False accepts per-device statistics, averaged over the devices each
call (PyTorch DDP without SyncBatchNorm): NOT one device's step. Either way the new state must have
the structure, shapes and dtypes of the state given.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jdp.core.algorithm import Step, device_step
from jdp.core.annotations import describe, has_annotations, host_if_elsewhere, own_mesh, say_once
from jdp.core.first_call import FirstCall
from jdp.core.audit import Audit, AuditError, audited_options
from jdp.core.fsdp import FullyShardedLayout, host_whole
from jdp.core.global_view import JitLayout
from jdp.core.layouts import LAYOUTS, UNSIZED
from jdp.core.loss import call_loss
from jdp.core.mesh import DATA_AXIS, make_mesh, users_mesh
from jdp.core.optim import OptimizerSpec, check_optimizer, for_reduction, with_grad_scale
from jdp.core.options import StepOptions
from jdp.core.placement import Placement
from jdp.core.constraints import constraints_refused
from jdp.core.precision import check_master_params, check_trainable, in_precision
from jdp.core.state import TrainState
from jdp.core.zero import ShardedStateLayout
from jdp.cpu import RunAhead


class TrainStep:
    """A compiled data-parallel training step. Build it with `make_train_step`."""

    def __init__(self, loss_fn: Callable, optimizer, options: StepOptions, devices=None, param_axes=None, mesh=None):
        if isinstance(optimizer, optax.MultiSteps):  # optax's accumulating wrapper: checked in init with the rest
            optimizer = optimizer.gradient_transformation()
        if not isinstance(optimizer, (optax.GradientTransformation, OptimizerSpec)):
            raise ValueError(f"optimizer must be an optax.GradientTransformation or a jdp.OptimizerSpec, "
                             f"got {type(optimizer).__name__}.")
        if not callable(loss_fn):
            raise ValueError(f"loss_fn must be callable, got {type(loss_fn).__name__}.")
        self.options = o = options
        self.mesh, data_axis = ((make_mesh(devices, o.axis_name, o.replicas), None) if mesh is None
                                else users_mesh(mesh, devices, o.axis_name, o.backend, o.replicas))
        self.devices = list(self.mesh.devices.flat)
        self.num_devices = len(self.devices)
        self.local_devices = len(self.mesh.local_devices)  # this process's share of the mesh
        self.multi_process = jax.process_count() > 1
        if self.multi_process and o.backend == "pmap":
            raise ValueError("multi-process runs need backend='shard_map'; pmap feeds process-local devices only.")
        self.optimizer = step_optimizer(optimizer, o, self.num_devices)
        self._given_optimizer = optimizer
        # accum_sync="last" sums per device; "every" (M > 1) sums reduced, replicated metrics.
        accum = "per_device" if o.local_accum else "replicated" if o.multi_steps else None
        self.layout = (JitLayout(self.mesh, accum, self.optimizer, "params" if o.shard_params else
                                 "optimizer" if o.shard_optimizer_state else None, data_axis) if o.backend == "jit"
                       else FullyShardedLayout(self.mesh, accum, self.optimizer, o.precision, o.gather_in_model)
                       if o.shard_params
                       else ShardedStateLayout(self.mesh, accum, self.optimizer) if o.shard_optimizer_state
                       else LAYOUTS[o.backend](self.mesh, accum))
        if has_annotations(param_axes) and o.backend == "jit":
            self.layout.annotate(param_axes, dict(o.axis_rules))
        elif has_annotations(param_axes):
            say_once(f"the params' sharding annotations (e.g. {describe(param_axes)}) are set aside under "
                     f"backend={o.backend!r}, which keeps whole params on every device; backend='jit' honours them.")
        # a sharding constraint inside the model fails under the per-device backends: said in one sentence
        declared = partial(call_loss, constraints_refused(loss_fn, o.backend), o)  # as declared, before any cast
        self._loss = in_precision(declared, o.precision, o.mask_key)
        self._first = FirstCall(self.layout, self.mesh, declared, self._loss, o,
                                partial(call_loss, loss_fn, audited_options(o)))
        algorithm = Step(self._loss, self.layout.step_optimizer(self.optimizer), o, self.layout)
        self._step = self.layout.compile(partial(self._traced, algorithm))
        self._init = None  # built by init, once the layout knows the params' shapes
        self.run_ahead = RunAhead(self.devices)  # bounds steps in flight on CPU devices (see jdp.cpu)
        self._placement = Placement(self.mesh, self.layout, o, self.local_devices, self.multi_process)
        self.trace_count = 0  # how often the step was traced (= compiled); tests assert it stays 1

    def __getattr__(self, name):  # the options read as attributes: step.accum_steps, step.backend, ...
        if name in StepOptions.__dataclass_fields__:
            return getattr(self.options, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _traced(self, algorithm: Step, state, batch):
        self.trace_count += 1
        return device_step(state, batch, algorithm)

    def _init_state(self, params, model_state, key, aux) -> TrainState:
        zero = jnp.zeros((), jnp.int32)
        state = TrainState(step=zero, micro_step=zero, params=params, opt_state=self.optimizer.init(params),
                           model_state=model_state, rng=key, skipped=zero, skip_streak=zero)
        return self.layout.spread(state).replace(accum=self.layout.empty_accum(params, aux))

    def init(self, params, model_state=(), *, seed: int = 0, example_batch=None) -> TrainState:
        """The initial state: `params` (a pytree of arrays, the same on every host) on every device.

        `model_state` (has_state=True) is the model's non-parameter state, e.g. BatchNorm statistics.
        `seed` fixes the base RNG key from which per-micro-step, per-device keys are derived.
        `example_batch` (optional): a global micro-batch that sizes the accumulator's aux now
        instead of on the first call.
        """
        if not jax.tree.leaves(params):
            raise ValueError("params has no array leaves; pass a pytree of arrays.")
        # a model made under jax.set_mesh holds its params on that mesh: the step's own mesh takes them
        params, model_state = host_if_elsewhere((params, model_state), self.mesh)
        with own_mesh(self.mesh):
            return self._init_on_mesh(params, model_state, seed, example_batch)

    def _init_on_mesh(self, params, model_state, seed: int, example_batch) -> TrainState:
        check_trainable(params)
        check_master_params(params, self.options.precision)
        check_optimizer(self._given_optimizer, params, self.options.accum_steps)
        if jax.tree.leaves(model_state) and not self.options.has_state:
            raise ValueError("model_state was given but the step was made without has_state=True, so loss_fn "
                             "would never see or update it.")
        if self.layout.bind(params) or self._init is None:
            self._init = jax.jit(self._init_state, out_shardings=self.layout.state_shardings)
        state = self._init(params, model_state, jax.random.key_data(jax.random.key(seed)),
                           UNSIZED if self.options.has_aux else {})
        return state if example_batch is None else self._first.sized(state, self.shard_batch(example_batch))

    def shard_batch(self, batch):
        """Validate a global (micro-)batch (leading axis N·b on every leaf) and place it on the devices.

        In a multi-process run each process passes its own contiguous slice (its local devices × b
        rows); the slices form one global array.
        """
        return self._placement.place(batch)

    def micro_batches(self, global_batch) -> list:
        """Split a global batch of M·N·b examples into the M micro-batches the calls consume, in order."""
        return self._placement.micro_batches(global_batch)

    def _check_state(self, state):
        check_state(state, self.layout.stacked, self.options.backend)

    def __call__(self, state: TrainState, batch):
        """One call on a global micro-batch (N·b examples); returns (new state, metrics).

        The params change on every `accum_steps`-th call. `state` is donated (except with pmap on
        CPU devices): use the returned state afterwards. `metrics` are device values, the same on
        every device: `loss` (mean over the examples the step's gradient covers: this call's N·b,
        or with accum_steps=M > 1 the whole M·N·b global batch, NaN on calls that do not update;
        a weighted loss's mean over all their weight), `weight` (a weighted loss or mask_key only:
        that global weight, e.g. the step's real tokens), `grad_norm` (global norm of that
        gradient; only with grad_norm=True), `aux` (has_aux: means like `loss`), `updated` (this call applied an update), `skipped` (this call's
        update was skipped for a NaN/Inf gradient), `skip_streak`, `step` (optimizer steps so far)
        and `micro_step` (calls so far).
        """
        self._check_state(state)
        with own_mesh(self.mesh):
            batch = self.shard_batch(batch)
            state = self._first.sized(state, batch)
            if not self._first.model_state_checked:
                self._first.check_model_state(state, batch)
            if not self._first.audited:
                self._first.audit(state, batch, first_call=True)
            self.run_ahead.wait()
            state, metrics = self._step(state, batch)
        self.run_ahead.launched(metrics["micro_step"])
        return state, metrics

    def audit(self, state: TrainState, batch) -> Audit:
        """The `Audit` of a plain loss on this (micro-)batch (`jdp.core.audit`), as the first call runs it
        unless audit=False; `AuditError` (a ValueError) for a loss that is not a mean over its rows."""
        self._check_state(state)
        with own_mesh(self.mesh):
            return self._first.audit(state, self.shard_batch(batch))

    def canonical(self, state: TrainState) -> TrainState:
        """One device-count-independent copy of `state` (pmap's stacking undone, accumulator dropped).

        This is what checkpoints hold; take it at an optimizer-step boundary, where the
        accumulator is empty.
        """
        self._check_state(state)
        return self.layout.canonical(state.replace(accum=None))

    def place(self, canonical: TrainState, like: TrainState) -> TrainState:
        """Put a `canonical` state into this step's layout; `like` (from `init`) gives the accumulator."""
        self._check_state(like)
        build = lambda c, a: self.layout.spread(c.replace(accum=a))  # noqa: E731
        with own_mesh(self.mesh):
            return jax.jit(build, out_shardings=self.layout.state_shardings)(canonical, like.accum)

    def evaluate(self, state: TrainState, metric_fn: Callable, data, batch_size: int = 256) -> dict[str, float]:
        """Exact metrics over a whole dataset, data-parallel: see `jdp.core.evaluate.evaluate_state`."""
        from jdp.core.evaluate import evaluate_state  # the data pipeline it uses is not needed to train

        return evaluate_state(self, state, metric_fn, data, batch_size)

    def lower(self, state: TrainState, batch) -> jax.stages.Lowered:
        """The lowered step for this state and batch (e.g. `.compile().as_text()` to read the HLO)."""
        self._check_state(state)
        with own_mesh(self.mesh):
            batch = self.shard_batch(batch)
            return self._step.lower(self._first.sized(state, batch), batch)


def step_optimizer(optimizer, o: StepOptions, n: int) -> optax.GradientTransformation:
    """The transformation the step applies to the reduced gradient: `optimizer` with the psum
    correction, in optax.MultiSteps for "every" (which divides a weighted loss's gradient sums by the
    step's whole weight: `with_grad_scale`)."""
    tx = for_reduction(optimizer, o.lr_correction, n)
    if not o.multi_steps:
        return tx
    return optax.MultiSteps(with_grad_scale(tx), every_k_schedule=o.accum_steps).gradient_transformation()


def check_state(state, stacked: bool, backend: str) -> None:
    """Refuse, in one sentence, a state this step cannot take."""
    if not isinstance(state, TrainState):
        raise ValueError(f"state must be the TrainState from step.init, got {type(state).__name__}.")
    # Donation deletes every buffer of the state at once: its step counter stands for all of them.
    if isinstance(state.step, jax.Array) and state.step.is_deleted():
        raise ValueError("state was donated to an earlier call of the step and its buffers are gone; use "
                         "the state that call returned (`state, metrics = step(state, batch)`).")
    if state.stacked != stacked:
        raise ValueError(f"state was made for the {'pmap' if state.stacked else 'shard_map'} backend; "
                         f"this step uses {backend!r}.")


def make_train_step(loss_fn: Callable, optimizer: optax.GradientTransformation | OptimizerSpec, *,
                    backend: str = "shard_map", reduction: str = "mean", lr_correction: str | None = None,
                    devices: Sequence[jax.Device] | None = None, has_aux: bool = False,
                    needs_rng: bool = False, has_state: bool = False, mask_key: str | None = "auto",
                    accum_steps: int = 1, accum_sync: str = "every", skip_nonfinite: bool = False,
                    grad_norm: bool = True, precision="float32", reduce_dtype=None,
                    shard_optimizer_state: bool = False, shard_params: bool = False,
                    axis_name: str = DATA_AXIS, sync_batchnorm: bool = True,
                    gather_in_model: bool = False, replicas: int = 1, axis_rules: dict | None = None,
                    param_axes=None, audit: bool = True, mesh: jax.sharding.Mesh | None = None) -> TrainStep:
    """Build a data-parallel training step.

    Args:
      loss_fn: `loss_fn(params, batch) -> scalar`, the MEAN loss over the examples it is given, or
        `jdp.Weighted(sum, weight)` for a weighted mean (per token: the sum of the real tokens'
        losses and their count; divided by the global weight once). `loss_fn(params, batch, rng)`
        if `needs_rng`; `(loss, aux)` if `has_aux`, where aux is a pytree of scalars that are
        per-example means, such as accuracy (or `jdp.Weighted` sums).
      optimizer: any `optax.GradientTransformation`, or a `jdp.OptimizerSpec`.
      backend: "shard_map" (jit over a 1-D mesh; the loss runs per device), "pmap", or "jit" (the
        global view: `jax.jit` over global arrays, the loss sees the whole global micro-batch and
        the partitioner places the all-reduce; `jdp.core.global_view` says what it refuses).
      reduction: "mean" (`lax.pmean`: the gradient of the global-batch mean loss) or "sum"
        (`lax.psum`: N times that gradient).
      lr_correction: only with reduction="sum": "auto" (there the default: lr/N), "none" or "exact"
        (an OptimizerSpec's scale-dependent hyperparameters changed; `jdp.core.step`'s docstring).
      devices: the devices to use (`jax.Device`s or their integer ids), default all of them.
      has_aux: `loss_fn` returns `(loss, aux)`.
      needs_rng: `loss_fn` takes a last argument, a key derived from (seed, micro-step, device).
      has_state: the model has non-parameter state (BatchNorm statistics): `loss_fn(params,
        model_state, batch[, rng]) -> (loss, new_model_state)`, or `(loss, (aux, new_model_state))`
        with has_aux; the new state is averaged over devices each call (synchronised BatchNorm's agrees).
      mask_key: the batch entry of 1/0 weights marking real/padded examples of a loss
        `sum(mask · l) / b`; loss and gradient are then means over the real ones. "auto" (default):
        none, and a plain mean loss beside an entry named "mask" is refused as ambiguous; None: none.
      accum_steps: M, the micro-batches per optimizer step. Each call takes one micro-batch; the
        params change on every M-th call, by the step one device would take on all M·N·b examples.
      accum_sync: "every" (optax.MultiSteps; an all-reduce on every call) or "last" (local sums;
        one all-reduce per optimizer step, on the call that applies the update).
      skip_nonfinite: skip, on every device, an optimizer step whose gradient or result holds a
        NaN/Inf; `state.skipped` and `state.skip_streak` count them (`jdp.core.step`'s docstring).
      grad_norm: report `metrics["grad_norm"]`, the reduced gradient's global L2 norm (float32; one more read).
      precision: "float32" or "bfloat16" ("fp32"/"bf16", or the jnp dtypes): the dtype loss_fn's
        forward and backward compute in, on float32 master params; float16 is refused
        (`jdp.core.step`'s docstring).
      reduce_dtype: the dtype the gradient is all-reduced in; None (default) keeps the gradient's
        own; "bfloat16" halves the all-reduce's bytes (`jdp.core.step`'s docstring).
      shard_optimizer_state: ZeRO stage 1 (shard_map or jit): each device keeps 1/N of the optimizer
        state; the same step, the same ring traffic (`jdp.core.step`'s docstring, `jdp.zero`).
      shard_params: fully sharded data parallel (shard_map or jit; implies shard_optimizer_state):
        each device keeps 1/N of every params leaf too (`jdp.core.step`'s docstring, `jdp.fsdp`).
      gather_in_model: shard_params only: hand the loss every split params leaf as a
        `jdp.fsdp.Split` (this device's block) for the model to gather itself with
        `jdp.fsdp.gather`, one layer at a time inside its scanned layers (`jdp.core.split`).
      replicas: hybrid sharding (with shard_params or shard_optimizer_state): the N devices form
        `replicas` groups of N/replicas (consecutive devices; one per host with a group per process);
        the state is split within a group and replicated across groups, so the gradient is
        reduce-scattered within each group and its blocks all-reduced across them (PyTorch FSDP's
        HYBRID_SHARD). The mesh is 2-D, ("replica", "shard"); the batch is split over both.
      axis_name: the mesh axis the step binds and reduces over (default "data"); code that reduces
        over its own axis ('batch') runs unchanged with it (`jdp.core.step`'s docstring).
      sync_batchnorm: has_state only. True (default): the new model state must come out of the loss
        the same on every device (checked on the first call); False averages per-device statistics,
        which is NOT one device's step (`jdp.core.step`'s docstring).
      axis_rules: backend="jit" only: a dict from the axis names of the params' sharding
        annotations to jdp's mesh axes (`axis_name`; with replicas > 1 "replica", "shard") or None
        (replicated); a name that is not mapped and is not one of jdp's axes is replicated
        (`jdp.core.annotations`).
      param_axes: the params' sharding annotations: a pytree like params of PartitionSpecs or
        tuples of axis names per leaf (None: not annotated), e.g. `nnx.get_partition_spec(state)`;
        `jdp.nnx` and `jdp.linen` read them from the model. Honoured under backend="jit", set
        aside (said once) under "shard_map" and "pmap".
      audit: True (default): the first call checks that a plain scalar loss is a mean over its rows,
        on a few rows of every part the step calls it on (each device's under shard_map and pmap,
        each micro-batch's with accum_steps > 1; `jdp.core.audit`), and refuses one that is not (a
        division by each part's own count of tokens, a sum, a fixed divisor); False skips the check.
      mesh: backend="jit" only: run the step on this `jax.sharding.Mesh` (its own axis names and
        types, e.g. the Explicit ("fsdp", "tensor") mesh a model was made under) instead of jdp's
        1-D mesh over `devices`: the batch is split over `axis_name` if the mesh has it, else over
        its one axis of more than one device; the params' annotations naming its axes are
        honoured as they are, and shard_params/shard_optimizer_state split along the batch axis
        (`jdp.core.mesh.users_mesh`).

    Returns:
      A `TrainStep`: `state = step.init(params)`, `state, metrics = step(state, batch)` where the
      batch's leading axis is the GLOBAL batch N·b, split evenly over the N devices.
    """
    options = StepOptions(backend=backend, reduction=reduction, lr_correction=lr_correction, has_aux=has_aux,
                          needs_rng=needs_rng, has_state=has_state, mask_key=mask_key, accum_steps=accum_steps,
                          accum_sync=accum_sync, skip_nonfinite=skip_nonfinite, grad_norm=grad_norm,
                          precision=precision, reduce_dtype=reduce_dtype, shard_optimizer_state=shard_optimizer_state,
                          shard_params=shard_params, axis_name=axis_name, sync_batchnorm=sync_batchnorm,
                          gather_in_model=gather_in_model, replicas=replicas, axis_rules=axis_rules, audit=audit)
    return TrainStep(loss_fn, optimizer, options, devices, param_axes, mesh)


def get_params(state: TrainState):
    """The params as a host numpy pytree with their original (unreplicated) shapes (gathered from
    the devices' slices with shard_params)."""
    return get_tree(state, state.params)


def get_tree(state: TrainState, tree):
    """Any part of `state` (e.g. `state.opt_state`) as host numpy, one copy, original shapes; a
    sharded leaf of the optimizer state (shard_optimizer_state) whole, as the step holds it
    (`step.canonical(state)` gives it the params' shapes); sharded params in their shapes."""
    def host(x):
        if state.stacked:
            return np.asarray(x.addressable_data(0))[0]
        return np.asarray(x.addressable_data(0)) if x.sharding.is_fully_replicated else host_whole(x)

    return jax.tree.map(host, tree)
