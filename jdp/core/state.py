"""The train state, and the per-device keys derived from it."""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
from flax import struct
from jax import lax

from jdp.core.mesh import DATA_AXIS


class LocalAccum(NamedTuple):
    """One device's sums over the calls of the current optimizer step (accum_steps > 1); NOT replicated.

    accum_sync="last" sums this device's own micro-batch values and reduces them once, on the M-th
    call. accum_sync="every" reduces on every call and sums only the reduced loss, aux and weight, to
    report their means over the step (grads is None).
    """

    grads: Any  # sum of this device's micro-batch gradients, same pytree as params
    loss: jax.Array  # float32: sum of the micro-batch losses (means, or a weighted loss's sums)
    aux: Any  # sum of the micro-batch aux metrics (None until the first call has shown aux's structure)
    weight: jax.Array  # float32: sum of a weighted loss's weights since the last update (1 per call otherwise)


class TrainState(struct.PyTreeNode):
    """Everything a step reads and writes. All of it is identical on every device except `accum`."""

    step: jax.Array  # int32 scalar: optimizer steps (updates) taken so far
    micro_step: jax.Array  # int32 scalar: calls (micro-batches) taken so far; = step with accum_steps=1
    params: Any  # the model's parameters, any pytree of arrays
    opt_state: Any  # the optax state (an optax.MultiStepsState with accum_sync="every")
    model_state: Any  # non-parameter model state (BatchNorm statistics); () without has_state
    rng: jax.Array  # uint32[2] base key; each micro-step and device derives its own key from it
    skipped: jax.Array  # int32: updates skipped for non-finite gradients (skip_nonfinite=True)
    skip_streak: jax.Array  # int32: consecutive skipped updates up to now
    accum: LocalAccum | None = None  # accum_steps > 1 only: leaves (N, ...), one row per device
    stacked: bool = struct.field(pytree_node=False, default=False)  # pmap layout: every leaf is (N, ...)


def device_key(base_key: jax.Array, micro_step: jax.Array, axis: str | None = DATA_AXIS) -> jax.Array:
    """The key one device uses at `micro_step`: a function of (seed, micro-step, device index) only.

    `micro_step` counts calls (step · accum_steps + micro-step within it). Never a function of
    host state or of how often the step was compiled: masks are reproducible, and differ on every
    device and every micro-step. `axis` None (backend="jit", one program on the global batch): the
    key of device 0, for the whole batch, so the masks are those a one-device step draws.
    """
    key = jax.random.fold_in(base_key, micro_step)
    return jax.random.fold_in(key, 0 if axis is None else lax.axis_index(axis))
