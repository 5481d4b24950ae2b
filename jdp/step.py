"""`make_train_step`: grad -> reduce -> update, on N devices, equal to one device on the global batch.

The per-device function `_device_step` is the whole algorithm. Two backends run it:

- "shard_map": `jax.jit(jax.shard_map(...))` over a 1-D mesh. State is one replicated global array
  per leaf; the batch is one global array split along `DATA_AXIS`.
- "pmap": `jax.pmap(...)`. State leaves carry a leading device axis of size N (one copy each);
  the batch is reshaped to (N, b, ...). Every argument is mapped on axis 0: `in_axes=None` on an
  empty pytree (e.g. `optax.sgd`'s state) shifts the axes of the next argument in jax 0.10.2.
"""
from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax import lax
from jax.sharding import PartitionSpec as P

from jdp.mesh import DATA_AXIS, batch_sharded, make_mesh, replicated
from jdp.optim import OptimizerSpec, exact_sum_spec
from jdp.reduce import REDUCTIONS, mean_over_devices, reduce_gradients

BACKENDS = ("shard_map", "pmap")
LR_CORRECTIONS = ("auto", "none", "exact")


class TrainState(struct.PyTreeNode):
    """Everything a step reads and writes; identical on every device."""

    step: jax.Array  # int32 scalar: optimizer steps taken so far
    params: Any  # the model's parameters, any pytree of arrays
    opt_state: Any  # the optax state of `optimizer`
    rng: jax.Array  # uint32[2] base key; each step and device derives its own key from it
    stacked: bool = struct.field(pytree_node=False, default=False)  # pmap layout: leaves are (N, ...)


def device_key(base_key: jax.Array, step: jax.Array) -> jax.Array:
    """The key one device uses at `step`: a function of (seed, step, device index) only.

    Never of host state or of how often the step was compiled, so dropout masks are reproducible,
    and different on every device and every step.
    """
    return jax.random.fold_in(jax.random.fold_in(base_key, step), lax.axis_index(DATA_AXIS))


class TrainStep:
    """A compiled data-parallel training step. Build it with `make_train_step`."""

    def __init__(self, loss_fn, optimizer, *, backend, reduction, lr_correction, devices, has_aux, needs_rng):
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r} is not supported; use one of {BACKENDS}.")
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction={reduction!r} is not supported; use one of {REDUCTIONS}.")
        if not isinstance(optimizer, (optax.GradientTransformation, OptimizerSpec)):
            raise ValueError(f"optimizer must be an optax.GradientTransformation or a jdp.OptimizerSpec, "
                             f"got {type(optimizer).__name__}.")
        if not callable(loss_fn):
            raise ValueError(f"loss_fn must be callable, got {type(loss_fn).__name__}.")
        self.loss_fn = loss_fn
        self.backend, self.reduction = backend, reduction
        self.has_aux, self.needs_rng = has_aux, needs_rng
        self.mesh = make_mesh(devices)
        self.devices = list(self.mesh.devices.flat)
        self.num_devices = len(self.devices)
        self.lr_correction = _resolve_lr_correction(reduction, lr_correction, optimizer)
        self.optimizer = _corrected_optimizer(optimizer, self.lr_correction, self.num_devices)
        # Steps allowed in flight before __call__ waits for the oldest (None: unbounded). On CPU
        # devices XLA admits 32 per device and then blocks a client-pool thread per launch, which
        # can starve the threads that run the steps and deadlock the all-reduce (jdp/cpu.py).
        self.max_inflight = 8 if all(d.platform == "cpu" for d in self.devices) else None
        self._inflight = collections.deque()
        self.trace_count = 0  # how often the step was traced (= compiled); tests assert it stays 1
        stacked = backend == "pmap"
        self._init = jax.jit(partial(self._init_state, stacked=stacked),
                             out_shardings=batch_sharded(self.mesh) if stacked else replicated(self.mesh))
        if backend == "shard_map":
            mapped = jax.shard_map(self._device_step, mesh=self.mesh,
                                   in_specs=(P(), P(DATA_AXIS)), out_specs=(P(), P()), check_vma=True)
            self._step = jax.jit(mapped, donate_argnums=0)
        else:
            self._step = jax.pmap(self._device_step, axis_name=DATA_AXIS, devices=self.devices,
                                  donate_argnums=0)

    # The per-device step: the algorithm, in order.
    def _device_step(self, state: TrainState, batch):
        """One step on one device's b examples; returns the replicated new state and metrics."""
        self.trace_count += 1
        params = state.params
        if self.backend == "shard_map":
            # Replicated params are axis-invariant; differentiating w.r.t. them makes jax.grad
            # sum the gradient over devices itself (and pmean becomes the identity). Cast them to
            # per-device values outside the loss so grad returns this device's own gradient.
            params = lax.pcast(params, DATA_AXIS, to="varying")
        args = (batch, device_key(state.rng, state.step)) if self.needs_rng else (batch,)

        # 1. grad: the mean loss over this device's b examples, and its gradient.
        (loss, aux), grads = jax.value_and_grad(self._loss_and_aux, has_aux=True)(params, *args)
        # 2. reduce: over N devices -> the gradient of the mean loss over all N·b examples.
        grads = reduce_gradients(grads, self.reduction)
        # 3. update: the same optimizer step on every device, so replicas stay identical.
        updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)

        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        return new_state, self._metrics(loss, grads, aux)

    def _loss_and_aux(self, params, *args):
        out = self.loss_fn(params, *args)
        if not self.has_aux:
            return out, {}
        if not (isinstance(out, tuple) and len(out) == 2):
            raise ValueError(f"has_aux=True needs loss_fn to return (loss, aux), got {type(out).__name__}.")
        return out

    def _metrics(self, loss, grads, aux):
        """Per-device means averaged over devices: means over all N·b examples (equal shards)."""
        # The norm in float32: squaring fp16 gradients overflows long before the gradients do.
        grad_norm = optax.tree.norm(jax.tree.map(lambda g: g.astype(jnp.float32), grads))
        metrics = {"loss": mean_over_devices(loss), "grad_norm": grad_norm}
        if self.has_aux:
            metrics["aux"] = mean_over_devices(aux)
        return metrics

    # Host side: placing state and batches, calling the compiled step.
    def _init_state(self, params, key, *, stacked: bool) -> TrainState:
        state = TrainState(step=jnp.zeros((), jnp.int32), params=params,
                           opt_state=self.optimizer.init(params), rng=key)
        if stacked:
            state = jax.tree.map(lambda x: jnp.broadcast_to(x, (self.num_devices, *x.shape)), state)
        return state.replace(stacked=stacked)

    def init(self, params, *, seed: int = 0) -> TrainState:
        """The initial state: `params` (a pytree of arrays, the same on every host) on every device.

        `seed` fixes the base RNG key from which per-step, per-device keys are derived.
        """
        leaves = jax.tree.leaves(params)
        if not leaves:
            raise ValueError("params has no array leaves; pass a pytree of arrays.")
        return self._init(params, jax.random.key_data(jax.random.key(seed)))

    def shard_batch(self, batch):
        """Validate a global batch (leading axis = N·b on every leaf) and place it on the devices."""
        leaves = jax.tree.leaves(batch)
        if not leaves:
            raise ValueError("batch has no array leaves; pass a pytree of arrays with a leading batch axis.")
        sizes = {np.shape(x)[0] if np.ndim(x) else None for x in leaves}
        if None in sizes:
            raise ValueError("every batch leaf needs a leading batch axis; found a scalar.")
        if len(sizes) != 1:
            raise ValueError(f"batch leaves disagree on the global batch size: {sorted(sizes)}.")
        (size,) = sizes
        n = self.num_devices
        if size % n:
            raise ValueError(f"global batch size {size} does not divide evenly across {n} devices; "
                             f"use a multiple of {n}.")
        if self.backend == "pmap":
            batch = jax.tree.map(lambda x: np.reshape(x, (n, size // n, *np.shape(x)[1:])), batch)
        return jax.device_put(batch, batch_sharded(self.mesh))

    def _check_state(self, state):
        if not isinstance(state, TrainState):
            raise ValueError(f"state must be the TrainState from step.init, got {type(state).__name__}.")
        if state.stacked != (self.backend == "pmap"):
            raise ValueError(f"state was made for the {'pmap' if state.stacked else 'shard_map'} backend; "
                             f"this step uses {self.backend!r}.")

    def __call__(self, state: TrainState, batch):
        """One optimizer step on a global batch; returns (new state, metrics).

        `state` is donated: use the returned state afterwards. `metrics` are device scalars:
        `loss` (mean over all N·b examples), `grad_norm` (global norm of the reduced gradient),
        and `aux` (has_aux losses: the per-device means averaged over devices).
        """
        self._check_state(state)
        batch = self.shard_batch(batch)
        if self.max_inflight is not None and len(self._inflight) >= self.max_inflight:
            self._inflight.popleft().block_until_ready()  # waits only if the devices are far behind
        state, metrics = self._step(state, batch)
        if self.max_inflight is not None:
            self._inflight.append(metrics["loss"])
        if self.backend == "pmap":
            metrics = jax.tree.map(lambda m: m[0], metrics)
        return state, metrics

    def lower(self, state: TrainState, batch) -> jax.stages.Lowered:
        """The lowered step for this state and batch (e.g. `.compile().as_text()` to read the HLO)."""
        self._check_state(state)
        return self._step.lower(state, self.shard_batch(batch))


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
                    needs_rng: bool = False) -> TrainStep:
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
      needs_rng: `loss_fn` takes a third argument, a key derived from (seed, step, device index).

    Returns:
      A `TrainStep`: `state = step.init(params)`, `state, metrics = step(state, batch)` where the
      batch's leading axis is the GLOBAL batch N·b, split evenly over the N devices.
    """
    return TrainStep(loss_fn, optimizer, backend=backend, reduction=reduction, lr_correction=lr_correction,
                     devices=devices, has_aux=has_aux, needs_rng=needs_rng)


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
