"""`make_train_step`: grad -> reduce -> accumulate -> update, on N devices, equal to one device on
the global batch.

The per-device function `_device_step` is the whole algorithm. Two backends run it:

- "shard_map": `jax.jit(jax.shard_map(...))` over a 1-D mesh. State is one replicated global array
  per leaf; the batch is one global array split along `DATA_AXIS`.
- "pmap": `jax.pmap(...)`. State leaves carry a leading device axis of size N (one copy each);
  the batch is reshaped to (N, b, ...). Every argument is mapped on axis 0: `in_axes=None` on an
  empty pytree (e.g. `optax.sgd`'s state) shifts the axes of the next argument in jax 0.10.2.

Gradient accumulation over M micro-batches (seed 002: scale by 1/(D·M)) comes in two modes:
"every" wraps the optimizer in `optax.MultiSteps` and all-reduces on every call; "last" sums
each device's gradients locally and all-reduces once, inside the branch that applies the update.
"""
from __future__ import annotations

import collections
import weakref
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from jdp.mesh import DATA_AXIS, batch_sharded, make_mesh, replicated
from jdp.optim import OptimizerSpec, exact_sum_spec
from jdp.reduce import REDUCTIONS, reduce_step_values
from jdp.state import LocalAccum, TrainState, device_key

BACKENDS = ("shard_map", "pmap")
LR_CORRECTIONS = ("auto", "none", "exact")
ACCUM_SYNCS = ("every", "last")


class TrainStep:
    """A compiled data-parallel training step. Build it with `make_train_step`."""

    def __init__(self, loss_fn, optimizer, *, backend, reduction, lr_correction, devices, has_aux, needs_rng,
                 has_state, mask_key, accum_steps, accum_sync, skip_nonfinite, grad_norm):
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r} is not supported; use one of {BACKENDS}.")
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction={reduction!r} is not supported; use one of {REDUCTIONS}.")
        if not isinstance(optimizer, (optax.GradientTransformation, OptimizerSpec)):
            raise ValueError(f"optimizer must be an optax.GradientTransformation or a jdp.OptimizerSpec, "
                             f"got {type(optimizer).__name__}.")
        if not callable(loss_fn):
            raise ValueError(f"loss_fn must be callable, got {type(loss_fn).__name__}.")
        if isinstance(accum_steps, bool) or not isinstance(accum_steps, (int, np.integer)) or accum_steps < 1:
            raise ValueError(f"accum_steps={accum_steps!r} must be an integer of at least 1.")
        if accum_sync not in ACCUM_SYNCS:
            raise ValueError(f"accum_sync={accum_sync!r} is not supported; use one of {ACCUM_SYNCS}.")
        self.loss_fn = loss_fn
        self.backend, self.reduction = backend, reduction
        self.has_aux, self.needs_rng, self.has_state, self.mask_key = has_aux, needs_rng, has_state, mask_key
        self.accum_steps, self.accum_sync = int(accum_steps), accum_sync
        self.mesh = make_mesh(devices)
        self.devices = list(self.mesh.devices.flat)
        self.num_devices = len(self.devices)
        self.local_devices = len(self.mesh.local_devices)  # this process's share of the mesh
        self.multi_process = jax.process_count() > 1
        if self.multi_process and backend == "pmap":
            raise ValueError("multi-process runs need backend='shard_map'; pmap feeds process-local devices only.")
        self.lr_correction = _resolve_lr_correction(reduction, lr_correction, optimizer)
        self.optimizer = _corrected_optimizer(optimizer, self.lr_correction, self.num_devices)
        # With accum_sync="last", gradients wait in per-device sums until the M-th call.
        self.local_accum = self.accum_steps > 1 and accum_sync == "last"
        if skip_nonfinite and self.accum_steps > 1 and not self.local_accum:
            raise ValueError("skip_nonfinite=True needs accum_sync='last' when accum_steps > 1: with 'every', "
                             "optax.MultiSteps has already folded a non-finite micro-gradient into its state.")
        self.skip_nonfinite = bool(skip_nonfinite)
        if not isinstance(grad_norm, (bool, np.bool_)):
            raise ValueError(f"grad_norm={grad_norm!r} must be True or False.")
        self.grad_norm = bool(grad_norm)
        if self.accum_steps > 1 and accum_sync == "every":
            self.optimizer = optax.MultiSteps(self.optimizer, every_k_schedule=self.accum_steps).gradient_transformation()
        # Steps allowed in flight before __call__ waits for the oldest (None: unbounded). On CPU
        # devices XLA admits 32 per device and then blocks a client-pool thread per launch, which
        # can starve the threads that run the steps and deadlock the all-reduce (jdp/cpu.py).
        on_cpu = all(d.platform == "cpu" for d in self.devices)
        self.max_inflight = 16 if on_cpu else None
        self._inflight = collections.deque()
        self._placed = weakref.WeakValueDictionary()  # arrays shard_batch produced, by id
        self.trace_count = 0  # how often the step was traced (= compiled); tests assert it stays 1

        stacked = backend == "pmap"
        rep, split = replicated(self.mesh), batch_sharded(self.mesh)
        self._state_shardings = split if stacked else TrainState(
            step=rep, micro_step=rep, params=rep, opt_state=rep, model_state=rep, rng=rep, skipped=rep,
            skip_streak=rep, accum=split if self.local_accum else None)
        self._init = jax.jit(partial(self._init_state, stacked=stacked), out_shardings=self._state_shardings)
        if backend == "shard_map":
            state_specs = TrainState(step=P(), micro_step=P(), params=P(), opt_state=P(), model_state=P(), rng=P(),
                                     skipped=P(), skip_streak=P(), accum=P(DATA_AXIS) if self.local_accum else None)
            mapped = jax.shard_map(self._device_step, mesh=self.mesh, in_specs=(state_specs, P(DATA_AXIS)),
                                   out_specs=(state_specs, P()), check_vma=True)
            self._step = jax.jit(mapped, donate_argnums=0)
        else:
            # Metrics are reduced values, equal on every device: out_axes=None returns them once
            # instead of stacked (no per-call slicing). On CPU the state is not donated: jax.pmap
            # (jit of shard_map) squeezes the device axis, and with the state aliased in place XLA
            # copies every optimizer moment in and every param out (20 more copies for the benchmark
            # MLP on 2 devices, +32% step time); fresh output buffers need the same peak memory and
            # no copies.
            self._step = jax.pmap(self._device_step, axis_name=DATA_AXIS, devices=self.devices,
                                  out_axes=(0, None), donate_argnums=() if on_cpu else 0)

    # The per-device step: the algorithm, in order.
    def _device_step(self, state: TrainState, batch):
        """One call on one device's b examples; returns the new state and global metrics."""
        self.trace_count += 1
        params = state.params
        if self.backend == "shard_map":
            # Replicated params are axis-invariant; differentiating w.r.t. them makes jax.grad
            # sum the gradient over devices itself (and pmean becomes the identity). Cast them to
            # per-device values outside the loss so grad returns this device's own gradient.
            params = lax.pcast(params, DATA_AXIS, to="varying")
        key = device_key(state.rng, state.micro_step)
        updates_now = (state.micro_step + 1) % self.accum_steps == 0
        b = _batch_size(batch)  # this device's examples per call (static under tracing)
        masked = isinstance(batch, dict) and bool(self.mask_key) and self.mask_key in batch  # static
        examples = self._real_examples(batch, b)

        # 1. grad: the mean loss over this device's b examples, and its gradient.
        (loss, (aux, model_state)), grads = jax.value_and_grad(self._loss_and_extras, has_aux=True)(
            params, state.model_state, batch, key)
        if self.local_accum:
            params, opt_state, accum, metrics, skip = self._accumulate_then_update(
                state, grads, loss, aux, examples, b, updates_now, masked)
            model_state = state.model_state  # empty: init refuses model state with accum_sync="last"
        else:
            # 2. reduce: over N devices -> the gradient of the mean loss over all N·b examples
            #    (gradient, metrics, model state and example count in one all-reduce).
            grads, (loss, aux, model_state, examples) = reduce_step_values(
                grads, (loss, aux, model_state, examples), self.reduction)
            if masked:  # without a mask the factor is exactly 1: skip a pass over the gradient
                grads, loss, aux = self._over_real_examples((grads, loss, aux), examples, b)
            # 3. accumulate + update: MultiSteps (accum_steps > 1) averages the M reduced
            #    gradients and applies them on the M-th call; otherwise every call updates.
            updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
            params, opt_state, skip = self._unless_nonfinite(grads, state, optax.apply_updates(state.params, updates),
                                                             opt_state)
            accum = state.accum
            metrics = self._metrics(loss, grads, aux)

        streak = jnp.where(skip, state.skip_streak + 1, jnp.where(updates_now, 0, state.skip_streak))
        new_state = state.replace(step=state.step + updates_now.astype(jnp.int32), micro_step=state.micro_step + 1,
                                  params=params, opt_state=opt_state, model_state=model_state, accum=accum,
                                  skipped=state.skipped + skip.astype(jnp.int32), skip_streak=streak)
        metrics.update(updated=updates_now & ~skip, skipped=skip, skip_streak=streak, step=new_state.step,
                       micro_step=new_state.micro_step)
        return new_state, metrics

    def _unless_nonfinite(self, grads, state, params, opt_state):
        """With skip_nonfinite, keep the old params and optimizer state if the reduced gradient has
        a NaN/Inf (the same decision on every device: the gradient is already reduced)."""
        if not self.skip_nonfinite:
            return params, opt_state, jnp.zeros((), bool)
        finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)  # noqa: E731
        return keep(params, state.params), keep(opt_state, state.opt_state), ~finite

    def _accumulate_then_update(self, state, grads, loss, aux, examples, b, updates_now, masked):
        """accum_sync="last": sum locally; on the M-th call reduce once and apply the update."""
        m = self.accum_steps
        acc = self._local_view(state.accum)
        # 2. accumulate: this device's running sums, no communication.
        acc = jax.tree.map(jnp.add, acc, LocalAccum(grads, loss, aux, examples))

        def update(acc):
            # 3. reduce, once per optimizer step: (1/M)·Σ over micro-steps, then the mean over N
            #    devices = 1/(D·M) of the sum of all D·M micro-batch gradients (seed 002).
            mean_acc = jax.tree.map(lambda x: x / m, acc)
            g, (lo, au, ex) = reduce_step_values(mean_acc.grads, (mean_acc.loss, mean_acc.aux, mean_acc.examples),
                                                 self.reduction)
            if masked:
                g, lo, au = self._over_real_examples((g, lo, au), ex, b)
            # 4. update.
            updates, opt_state = self.optimizer.update(g, state.opt_state, state.params)
            params, opt_state, skip = self._unless_nonfinite(g, state, optax.apply_updates(state.params, updates),
                                                             opt_state)
            # Zeros that stay per-device values (x - x would keep a NaN from a skipped step).
            emptied = jax.tree.map(lambda x: jnp.where(True, jnp.zeros((), x.dtype), x), acc)
            return params, opt_state, emptied, self._metrics(lo, g, au), skip

        def hold(acc):
            # No communication on this call, so no global metrics either: NaN until the update.
            nan = lambda t: jax.tree.map(lambda x: jnp.full(x.shape, jnp.nan, jnp.float32), t)  # noqa: E731
            return (state.params, state.opt_state, acc, nan(jax.eval_shape(self._metrics, loss, grads, aux)),
                    jnp.zeros((), bool))

        params, opt_state, acc, metrics, skip = lax.cond(updates_now, update, hold, acc)
        return params, opt_state, self._global_view(acc), metrics, skip

    def _local_view(self, accum):
        # shard_map hands each device a (1, ...) slice of the (N, ...) accumulator; pmap a (...) one.
        return jax.tree.map(lambda x: x[0], accum) if self.backend == "shard_map" else accum

    def _global_view(self, accum):
        return jax.tree.map(lambda x: x[None], accum) if self.backend == "shard_map" else accum

    def _loss_and_extras(self, params, model_state, batch, key):
        """Call loss_fn as declared; always returns (loss, (aux, new_model_state))."""
        args = (params, *((model_state,) if self.has_state else ()), batch, *((key,) if self.needs_rng else ()))
        out = self.loss_fn(*args)
        if not (self.has_aux or self.has_state):
            return out, ({}, model_state)
        wanted = ("(loss, (aux, new_model_state))" if self.has_aux and self.has_state
                  else "(loss, aux)" if self.has_aux else "(loss, new_model_state)")
        if not (isinstance(out, tuple) and len(out) == 2):
            raise ValueError(f"loss_fn must return {wanted}, got {type(out).__name__}.")
        loss, extras = out
        if self.has_aux and self.has_state:
            if not (isinstance(extras, tuple) and len(extras) == 2):
                raise ValueError(f"loss_fn must return {wanted}.")
            return loss, extras
        return loss, (extras, model_state) if self.has_aux else ({}, extras)

    def _real_examples(self, batch, b: int) -> jax.Array:
        """This device's count of real examples: the mask's sum, or b without a mask."""
        mask = batch.get(self.mask_key) if isinstance(batch, dict) and self.mask_key else None
        return jnp.sum(mask, dtype=jnp.float32) if mask is not None else jnp.float32(b)

    def _over_real_examples(self, values, mean_examples, slots_per_call):
        """Rescale means over all slots to means over the real (unmasked) examples.

        A masked loss is `sum(mask · l) / b` per device, so the reduced mean is Σ(mask · l) / (N·b);
        multiplying by b / mean(real count per device) = N·b / R gives Σ(mask · l) / R. Without a
        mask the count is b and the factor is exactly 1.
        """
        scale = jnp.float32(slots_per_call) / mean_examples  # accumulated counts arrive divided by M
        return jax.tree.map(lambda x: (x * scale).astype(x.dtype), values)

    def _metrics(self, loss, grads, aux):
        """Global metrics from reduced values: means over all the examples the gradient covers."""
        # The norm in float32: squaring fp16 gradients overflows long before the gradients do.
        metrics = {"loss": loss.astype(jnp.float32)}
        if self.grad_norm:  # a pass over the reduced gradient: ~9% of an MLP step on 2 CPU devices
            metrics["grad_norm"] = optax.tree.norm(jax.tree.map(lambda g: g.astype(jnp.float32), grads))
        if self.has_aux:
            metrics["aux"] = aux
        return metrics

    # Host side: placing state and batches, calling the compiled step.
    def _init_state(self, params, model_state, key, aux_zeros, *, stacked: bool) -> TrainState:
        zero = jnp.zeros((), jnp.int32)
        accum = None
        if self.local_accum:
            per_device = LocalAccum(grads=jax.tree.map(jnp.zeros_like, params), loss=jnp.zeros((), jnp.float32),
                                    aux=aux_zeros, examples=jnp.zeros((), jnp.float32))
            accum = jax.tree.map(lambda x: jnp.zeros((self.num_devices, *x.shape), x.dtype), per_device)
        state = TrainState(step=zero, micro_step=zero, params=params, opt_state=self.optimizer.init(params),
                           model_state=model_state, rng=key, skipped=zero, skip_streak=zero, accum=None)
        if stacked:
            state = jax.tree.map(lambda x: jnp.broadcast_to(x, (self.num_devices, *x.shape)), state)
        return state.replace(accum=accum, stacked=stacked)

    def init(self, params, model_state=(), *, seed: int = 0, example_batch=None) -> TrainState:
        """The initial state: `params` (a pytree of arrays, the same on every host) on every device.

        `model_state` (has_state=True) is the model's non-parameter state, e.g. BatchNorm statistics.

        `seed` fixes the base RNG key from which per-micro-step, per-device keys are derived.
        `example_batch` (a global micro-batch) is needed only with accum_sync="last" and
        has_aux=True, to size the per-device aux accumulator.
        """
        if not jax.tree.leaves(params):
            raise ValueError("params has no array leaves; pass a pytree of arrays.")
        aux_zeros = {}
        if self.local_accum and self.has_aux:
            if example_batch is None:
                raise ValueError("accum_sync='last' with has_aux=True needs step.init(params, example_batch=batch) "
                                 "to size the per-device aux accumulator.")
            aux_zeros = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype),
                                     self._aux_shapes(params, model_state, example_batch))
        if jax.tree.leaves(model_state) and self.local_accum:
            raise ValueError("a model with state (e.g. BatchNorm statistics) needs accum_sync='every' when "
                             "accum_steps > 1: 'last' has no communication on which to keep the state replicated.")
        if jax.tree.leaves(model_state) and not self.has_state:
            raise ValueError("model_state was given but the step was made without has_state=True, so loss_fn "
                             "would never see or update it.")
        return self._init(params, model_state, jax.random.key_data(jax.random.key(seed)), aux_zeros)

    def _aux_shapes(self, params, model_state, batch):
        n = self.num_devices
        local = jax.tree.map(lambda x: jax.ShapeDtypeStruct((np.shape(x)[0] // n, *np.shape(x)[1:]),
                                                            jnp.asarray(x[:1]).dtype), batch)
        key = jax.ShapeDtypeStruct((2,), jnp.uint32)
        return jax.eval_shape(self._loss_and_extras, params, model_state, local, key)[1][0]

    def shard_batch(self, batch):
        """Validate a global (micro-)batch (leading axis N·b on every leaf) and place it on the devices.

        In a multi-process run each process passes its own contiguous slice (its local devices × b
        rows); the slices form one global array.
        """
        leaves = jax.tree.leaves(batch)
        if leaves and all(self._placed.get(id(x)) is x for x in leaves):
            return batch  # this step's shard_batch placed it already: use it as is
        n = self.local_devices
        size = _batch_size(batch)
        if size % n:
            where = f"this process's {n} devices" if self.multi_process else f"{n} devices"
            raise ValueError(f"global batch size {size} does not divide evenly across {where}; "
                             f"use a multiple of {n}.")
        if self.multi_process:
            placed = jax.tree.map(lambda x: jax.make_array_from_process_local_data(batch_sharded(self.mesh),
                                                                                   np.asarray(x)), batch)
        else:
            if self.backend == "pmap":
                batch = jax.tree.map(lambda x: np.reshape(x, (n, size // n, *np.shape(x)[1:])), batch)
            placed = jax.device_put(batch, batch_sharded(self.mesh))
        for x in jax.tree.leaves(placed):  # remembered weakly, so pre-staged batches skip this next time
            self._placed[id(x)] = x
        return placed

    def micro_batches(self, global_batch) -> list:
        """Split a global batch of M·N·b examples into the M micro-batches the calls consume, in order."""
        size, m, n = _batch_size(global_batch), self.accum_steps, self.local_devices
        if size % (m * n):
            raise ValueError(f"global batch size {size} is not accum_steps × devices × b = {m} × {n} × b "
                             f"for any whole b; use a multiple of {m * n}.")
        b = size // m
        return [jax.tree.map(lambda x: x[k * b:(k + 1) * b], global_batch) for k in range(m)]

    def _check_state(self, state):
        if not isinstance(state, TrainState):
            raise ValueError(f"state must be the TrainState from step.init, got {type(state).__name__}.")
        if state.stacked != (self.backend == "pmap"):
            raise ValueError(f"state was made for the {'pmap' if state.stacked else 'shard_map'} backend; "
                             f"this step uses {self.backend!r}.")

    def __call__(self, state: TrainState, batch):
        """One call on a global micro-batch (N·b examples); returns (new state, metrics).

        The params change on every `accum_steps`-th call. `state` is donated (except with pmap on
        CPU devices, see `__init__`): use the returned state afterwards. `metrics` are device
        values: `loss` (mean over the examples the reduced gradient covers: this call's N·b, or
        with accum_sync="last" the whole M·N·b global batch, NaN on calls that do not update),
        `grad_norm` (global norm of the reduced gradient, same coverage; only with
        grad_norm=True), `aux` (has_aux: means like `loss`), `updated` (this call applied an update),
        `step` (optimizer steps so far) and `micro_step` (calls so far).
        """
        self._check_state(state)
        batch = self.shard_batch(batch)
        if self.max_inflight is not None and len(self._inflight) >= self.max_inflight:
            self._inflight.popleft().block_until_ready()  # waits only if the devices are far behind
        state, metrics = self._step(state, batch)
        if self.max_inflight is not None:
            self._inflight.append(metrics["micro_step"])
        return state, metrics

    def canonical(self, state: TrainState) -> TrainState:
        """One device-count-independent copy of `state` (pmap's stacking undone, accumulator dropped).

        This is what checkpoints hold; take it at an optimizer-step boundary, where the
        accumulator of accum_sync="last" is empty.
        """
        self._check_state(state)
        state = state.replace(accum=None)
        if state.stacked:
            state = jax.tree.map(lambda x: x[0], state).replace(stacked=False)
        return state

    def place(self, canonical: TrainState, like: TrainState) -> TrainState:
        """Put a `canonical` state into this step's layout; `like` (from `init`) gives the accumulator."""
        self._check_state(like)

        def build(canonical, like):
            state = canonical
            if like.stacked:
                state = jax.tree.map(lambda x: jnp.broadcast_to(x, (self.num_devices, *x.shape)), state)
            return state.replace(accum=like.accum, stacked=like.stacked)

        return jax.jit(build, out_shardings=self._state_shardings)(canonical, like)

    def lower(self, state: TrainState, batch) -> jax.stages.Lowered:
        """The lowered step for this state and batch (e.g. `.compile().as_text()` to read the HLO)."""
        self._check_state(state)
        return self._step.lower(state, self.shard_batch(batch))


def _batch_size(batch) -> int:
    leaves = jax.tree.leaves(batch)
    if not leaves:
        raise ValueError("batch has no array leaves; pass a pytree of arrays with a leading batch axis.")
    sizes = {np.shape(x)[0] if np.ndim(x) else None for x in leaves}
    if None in sizes:
        raise ValueError("every batch leaf needs a leading batch axis; found a scalar.")
    if len(sizes) != 1:
        raise ValueError(f"batch leaves disagree on the global batch size: {sorted(sizes)}.")
    return sizes.pop()


def _resolve_lr_correction(reduction: str, lr_correction: str | None, optimizer) -> str:
    if reduction == "mean":
        if lr_correction not in (None, "none"):
            raise ValueError(f"lr_correction={lr_correction!r} only applies to reduction='sum'; the mean "
                             f"reduction already yields the global-batch gradient (use None or 'none').")
        return "none"
    lr_correction = "auto" if lr_correction is None else lr_correction
    if lr_correction not in LR_CORRECTIONS:
        raise ValueError(f"lr_correction={lr_correction!r} is not supported; use one of {LR_CORRECTIONS}.")
    if lr_correction == "exact" and not isinstance(optimizer, OptimizerSpec):
        raise ValueError("lr_correction='exact' needs a jdp.OptimizerSpec (it changes the spec's "
                         "scale-dependent hyperparameters), not a bare optax transformation.")
    return lr_correction


def _corrected_optimizer(optimizer, lr_correction: str, n: int) -> optax.GradientTransformation:
    """The transformation that consumes the reduced gradient, with the psum correction applied."""
    if lr_correction == "exact":
        return exact_sum_spec(optimizer, n).build()
    tx = optimizer.build() if isinstance(optimizer, OptimizerSpec) else optimizer
    if lr_correction == "auto":
        # Every optax update is linear in the learning rate, so scaling the update by 1/N is
        # lr/N for any optimizer: exact for SGD and momentum, wrong for Adam (see jdp explain).
        return optax.chain(tx, optax.scale(1.0 / n))
    return tx


def make_train_step(loss_fn: Callable, optimizer: optax.GradientTransformation | OptimizerSpec, *,
                    backend: str = "shard_map", reduction: str = "mean", lr_correction: str | None = None,
                    devices: Sequence[jax.Device] | None = None, has_aux: bool = False,
                    needs_rng: bool = False, has_state: bool = False, mask_key: str | None = "mask",
                    accum_steps: int = 1, accum_sync: str = "every", skip_nonfinite: bool = False,
                    grad_norm: bool = True) -> TrainStep:
    """Build a data-parallel training step.

    Args:
      loss_fn: `loss_fn(params, batch) -> scalar`, the MEAN loss over the examples it is given
        (`loss_fn(params, batch, rng)` if `needs_rng`; `(loss, aux)` if `has_aux`, where aux is a
        pytree of per-example means such as accuracy).
      optimizer: any `optax.GradientTransformation`, or a `jdp.OptimizerSpec`.
      backend: "shard_map" (jit over a 1-D mesh) or "pmap".
      reduction: "mean" (`lax.pmean`: the gradient of the global-batch mean loss) or "sum"
        (`lax.psum`: N times that gradient).
      lr_correction: only with reduction="sum". "auto" (the default there) scales every update by
        1/N, i.e. lr/N: exact for SGD/momentum, not for Adam (ε) or clipping. "none" keeps the raw
        sum. "exact" (needs an OptimizerSpec) changes the spec's scale-dependent hyperparameters
        instead (`jdp.optim.exact_sum_spec`), which makes sum equal mean for every spec.
      devices: the devices to use, default all of them.
      has_aux: `loss_fn` returns `(loss, aux)`.
      needs_rng: `loss_fn` takes a last argument, a key derived from (seed, micro-step, device).
      has_state: the model has non-parameter state (BatchNorm statistics):
        `loss_fn(params, model_state, batch[, rng]) -> (loss, new_model_state)`, or with has_aux
        `(loss, (aux, new_model_state))`. The new state is averaged over devices each call (a
        no-op for synchronised BatchNorm, whose statistics already agree).
      mask_key: a batch entry of 1/0 weights marking real/padded examples. When present, loss_fn
        must return `sum(mask · per-example loss) / b` and jdp rescales so that loss, gradient
        and aux are means over the real examples only (exact for accum_steps=1 and "last").
      accum_steps: M, the micro-batches per optimizer step. Each call takes one micro-batch; the
        params change on every M-th call, by the step one device would take on all M·N·b examples.
      accum_sync: "every" (optax.MultiSteps; an all-reduce on every call) or "last" (local sums;
        one all-reduce per optimizer step, on the call that applies the update).
      skip_nonfinite: an update whose reduced gradient holds a NaN/Inf is skipped on every device
        (params and optimizer state unchanged); `state.skipped` counts them, `state.skip_streak`
        counts consecutive ones, and metrics report `skipped`.
      grad_norm: report the global L2 norm of the reduced gradient as `metrics["grad_norm"]`
        (float32). It reads the whole gradient once more; False leaves it out.

    Returns:
      A `TrainStep`: `state = step.init(params)`, `state, metrics = step(state, batch)` where the
      batch's leading axis is the GLOBAL batch N·b, split evenly over the N devices.
    """
    return TrainStep(loss_fn, optimizer, backend=backend, reduction=reduction, lr_correction=lr_correction,
                     devices=devices, has_aux=has_aux, needs_rng=needs_rng, has_state=has_state,
                     mask_key=mask_key, accum_steps=accum_steps, skip_nonfinite=skip_nonfinite,
                     accum_sync=accum_sync, grad_norm=grad_norm)


def _first_copy(x: jax.Array) -> np.ndarray:
    return np.asarray(x.addressable_data(0))


def get_params(state: TrainState):
    """The params as a host numpy pytree with their original (unreplicated) shapes."""
    return get_tree(state, state.params)


def get_tree(state: TrainState, tree):
    """Any part of `state` (e.g. `state.opt_state`) as host numpy, one copy, original shapes."""
    if state.stacked:
        return jax.tree.map(lambda x: np.asarray(_first_copy(x)[0]), tree)
    return jax.tree.map(_first_copy, tree)
