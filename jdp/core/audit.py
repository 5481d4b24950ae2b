"""The first-step audit: does a plain scalar loss commute with the split over devices?

Under the per-device backends (shard_map, pmap) every device computes the loss over its own b rows
and jdp averages the N results. That is one device's step only if the loss is a mean over its rows:
a loss that divides by its own rows' count of real tokens (`sum(mask · l) / sum(mask)`) gives a mean
of per-device means, silently wrong when the counts differ between devices.

The audit asks the loss itself, on k rows of every device's shard (`AUDIT_ROWS`), in the step's own
layout (under FSDP the params gathered as the step gathers them), as one compiled forward pass:

- gathered: the loss of all N·k rows as one call, as one device would see them;
- own: the mean over the devices of each device's loss on its own k rows.

A mean over rows gives the same number both ways; a loss normalised by each device's own count does
not, when the audited rows' counts differ. To keep dropout out of the comparison, both are taken on
N·k rows with one key (the same positions get the same masks): `gathered` is the mean over the N
rotations of the gathered rows (device d evaluates them starting at its own block), `own` is each
device's k rows repeated N times (a mean over rows does not change; nor does a per-row-count
normalisation). The loss's new model state (BatchNorm statistics) is dropped; synchronised
statistics are those of the N·k rows both ways.

What it cannot see: a loss that divides by its own count on rows whose counts happen to be equal;
an own-count loss whose per-device means happen to agree to within `RTOL`; a normalisation over
micro-batches (accum_steps > 1 on one device); a loss whose randomness depends on the device
(a key folded with `lax.axis_index` inside it). It is not run for `jdp.Weighted` losses or under
`mask_key` (they carry their weight and are exact), under backend="jit" (the loss sees the whole
batch, so its own count is the global one), on one device, or with per-device BatchNorm
statistics (`sync_batchnorm=False`, which is not one device's step anyway).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jdp.core.mesh import data_axes

AUDIT_ROWS = 2  # k: rows of every device's shard the audit evaluates (fewer if a device has fewer)
# |gathered - own| above this fraction of the larger refuses the loss. Both are float32 sums of the
# same N·k per-row values in two orders (measured here: at most ~1e-7 of the loss, BatchNorm and
# bfloat16 models included); an own-count loss on packed rows differs by 1e-3 and more.
RTOL = 1e-4
ATOL = 1e-6  # a loss of ~0 differs by rounding that no fraction of it bounds


class Audit(NamedTuple):
    """What the audit found: `gathered` (the loss of the N·k audited rows as one call), `own` (the mean
    over devices of each device's loss on its own k rows), `rows` (k), and the verdict: "commutes",
    "refused", or why nothing was compared: "weighted" (`jdp.Weighted`, or a loss under `mask_key`),
    "global view" (backend="jit": the loss sees the whole batch), "one device", "per-device statistics" (`sync_batchnorm=False`), "not finite" (both NaN/Inf), "loss
    failed" (the first call's audit could not run the loss on its rows: the step then raises its own error)."""

    gathered: float
    own: float
    rows: int
    verdict: str


class AuditError(ValueError):
    """The audit's refusal of a loss that does not commute with the split; `audit` holds what it found."""

    def __init__(self, found: Audit, devices: int, backend: str):
        super().__init__(refusal(found, devices, backend))
        self.audit = found


def refusal(found: Audit, devices: int, backend: str) -> str:
    """The one sentence that refuses a loss which does not commute with the split."""
    return (f"loss_fn is not a mean over its rows: on {devices * found.rows} rows, {found.rows} from each of the "
            f"{devices} devices, its value as one call is {found.gathered:.7g} but the mean of the devices' values on "
            f"their own rows is {found.own:.7g}, as when it divides by each device's own count of tokens, so under "
            f"backend={backend!r} the step would follow a mean of per-device means, not one device's step: return "
            f"jdp.Weighted(sum of the losses, their count) (jdp divides by the global count once) or use "
            f"backend='jit' (the loss sees the whole batch), or pass audit=False to train it as it is.")


def skip_reason(options, devices: int) -> str | None:
    """Why the audit has nothing to check for these options, or None."""
    if options.backend == "jit":  # the loss sees the whole batch: its own count is the global count
        return "global view"
    if devices == 1:
        return "one device"
    if options.has_state and not options.sync_batchnorm:
        return "per-device statistics"
    return None


def verdict(gathered: float, own: float) -> str:
    """"commutes" when the two agree within RTOL (or neither is finite: nothing to compare), else "refused"."""
    finite = np.isfinite([gathered, own])
    if not finite.any():
        return "not finite"
    if not finite.all():  # a count of 0 on a device's own rows and not on all of them
        return "refused"
    return "commutes" if abs(gathered - own) <= RTOL * max(abs(gathered), abs(own)) + ATOL else "refused"


def _evaluations(loss, view, n: int, k: int, axis):
    """The per-device function: (gathered, own) as means over the devices, equal on every device."""

    def per_device(params, model_state, batch, rng, micro_step):
        own = jax.tree.map(lambda x: x[:k], batch)
        every = jax.tree.map(lambda x: lax.all_gather(x, axis, tiled=True), own)  # (N·k, ...), the same everywhere
        start = lax.axis_index(axis) * k
        rotated = jax.tree.map(lambda x: lax.dynamic_slice_in_dim(jnp.concatenate([x, x]), start, n * k), every)
        repeated = jax.tree.map(lambda x: jnp.concatenate([x] * n), own)
        key = jax.random.fold_in(rng, micro_step)  # one key on every device and for both calls
        whole = view(params)

        def value(rows):
            total, (_, _, weight) = loss(whole, model_state, rows, key)
            per_device.weighted = weight is not None
            return total.astype(jnp.float32)

        # One traced loss for both (vmapped over the pair): half the program of two calls to compile.
        pair = jax.vmap(value)(jax.tree.map(lambda x, y: jnp.stack([x, y]), rotated, repeated))
        return lax.pmean(pair[0], axis), lax.pmean(pair[1], axis)

    per_device.weighted = None
    return per_device


def params_view(layout):
    """The params as the loss sees them in `layout`, in their own dtype: whole (FSDP: gathered, one
    all-gather per split leaf), or `Split` blocks for a model that gathers them itself."""
    cuts = getattr(layout, "cuts", None)
    if getattr(layout, "name", None) != "fsdp":
        return lambda params: params
    if layout.in_model:
        return layout.marked
    return lambda params: cuts.treedef.unflatten([cuts.gather_leaf(x, i) for i, x in
                                                  enumerate(cuts.treedef.flatten_up_to(params))])


def audit_loss(layout, mesh, loss, options, state, placed, first_call: bool = False) -> Audit:
    """Run the audit on the placed batch `placed` with the step's `state` (in its layout).

    `loss(params, model_state, batch, key) -> (total, (aux, model_state, weight))`: the step's loss as
    declared (float32). Returns the `Audit`; a weighted loss is only traced (nothing compiled). On the
    first call (`first_call`), a loss that fails on the audit's rows is left to fail in the step
    itself, with the step's own message for its own shapes (verdict "loss failed").
    """
    n = layout.num_devices
    reason = skip_reason(options, n)
    if reason is not None:
        return Audit(float("nan"), float("nan"), 0, reason)
    b = jax.tree.leaves(layout.device_batch(placed))[0].shape[0]
    k = min(AUDIT_ROWS, b)
    axis = layout.axis
    per_device = _evaluations(loss, params_view(layout), n, k, axis)
    args = (state.params, state.model_state, placed, state.rng, state.micro_step)
    try:
        lowered = _lowered(per_device, layout, mesh, axis, state, args)
    except Exception:
        if not first_call:
            raise
        return Audit(float("nan"), float("nan"), k, "loss failed")
    if per_device.weighted:  # seen while lowering: nothing is compiled for a loss that carries its weight
        return Audit(float("nan"), float("nan"), k, "weighted")
    out = jax.device_get(lowered.compile()(*args))
    gathered, own = (float(np.asarray(x).reshape(-1)[0]) for x in out)
    return Audit(gathered, own, k, verdict(gathered, own))


def _lowered(per_device, layout, mesh, axis, state, args):
    """The audit's program, lowered (which traces the loss) in the layout: pmap, or shard_map under jit."""
    if state.stacked:
        return jax.pmap(per_device, axis_name=axis, devices=list(mesh.devices.flat)).lower(*args)
    specs = layout._specs
    mapped = jax.shard_map(per_device, mesh=mesh, in_specs=(specs.params, specs.model_state, P(data_axes(mesh)),
                                                             P(), P()), out_specs=P(), check_vma=False)
    return jax.jit(mapped).lower(*args)
