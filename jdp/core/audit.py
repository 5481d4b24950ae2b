"""The first-step audit: a loss whose value on a set of rows is not the mean of its values on equal
parts of those rows is refused, before step 1, under every backend and layout.

The step calls the loss on parts of the global batch: each device's rows under the per-device
backends (shard_map, pmap), each micro-batch with accum_steps > 1. Averaging the parts' values is
one device's step on the whole batch only for a loss that is a mean over its rows. A loss divided
by its own rows' count of tokens (`sum(l·w) / sum(w)`) becomes a mean of per-part means; a sum over
rows, or a division by a fixed count (`num_items_in_batch`), is off by the number of parts. So,
with P = (N if the backend is per-device else 1) × accum_steps parts (P = 1: the loss sees the
whole batch, which is one device's step whatever it is; nothing to check):

- rows: k (`AUDIT_ROWS`) rows from each of the P parts the step makes, k·M from each device's
  share (micro-batch m: rows from the m-th M-th of it, so that real count differences show), in the
  step's own layout (FSDP: params gathered as the step gathers them; jit: global arrays);
- a deterministic loss (needs_rng=False, or its traced value does not depend on the key: a forward
  dependence walk over its jaxpr, conservative where a sub-program takes the key): L(W) on the
  whole W = the P·k rows, against mean_j L(part_j); with devices and micro-batches both split,
  also the devices' k·M rows, which says where the loss fails;
- a random loss (dropout): differently shaped calls draw different masks, so the own-count
  comparison is on P·k rows with one key, where each row meets the same masks both ways: the mean
  over the P rotations of W against each part repeated P times; and a scale check dropout cannot
  fake (L(W) against mean_j L(part_j): a sum or fixed divisor gives ≈ P);
- model state (BatchNorm): a device evaluates its part with the axis bound, so synchronised
  statistics are the union's, as in the step; micro-batches legitimately have statistics of their
  own, so where the new model state depends on the rows (the same jaxpr walk; an NNX model's state
  of RNG counts does not) only the device dimension is audited;
- tolerance: that of the dtype the loss returns (`jdp.core.audit_verdict.tolerance`).

Every evaluation of one shape is one traced loss (vmapped), compiled once, on the first call only.
Aux leaves (plain scalars) are judged the same way and named once on stderr when they are not means
over their rows (jdp averages aux; a count comes out divided); they are never refused.

What it cannot see: own counts that happen to be equal on the audited rows (or means that agree to
within the tolerance; bfloat16 returns hide differences below a few of its eps); micro-batch
normalisations of a loss whose model state holds batch statistics; `jdp.Weighted` losses (exact by construction, not
audited); randomness the loss derives from the device (a key folded with `lax.axis_index`).
"""
from __future__ import annotations

from dataclasses import replace
from functools import partial

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jdp.core.annotations import say_once
from jdp.core.audit_verdict import Audit, AuditError, aux_note, judge, tolerance
from jdp.core.mesh import data_axes

__all__ = ["AUDIT_ROWS", "Audit", "AuditError", "audit_loss", "audited_options"]

AUDIT_ROWS = 2  # k: rows of every part the audit evaluates (fewer if a part has fewer)


def audited_options(options):
    """The options the audit calls the loss with: under mask_key the loss's own value, `sum(mask·l)/b`
    (a mean over rows), not jdp's weighted form of it."""
    return replace(options, mask_key=None) if options.mask_key not in (None, "auto") else options


def split_of(options, devices: int) -> tuple[int, int]:
    """(devices, micro-batches) the step calls the loss on: P is their product (micro-batches with batch
    statistics in the model state are set aside when the loss is traced: `batch_statistics`)."""
    per_device = 1 if options.backend == "jit" else devices
    return per_device, options.accum_steps


def skip_reason(options, devices: int) -> str | None:
    """Why the audit has nothing to check for these options (P = 1), or None."""
    if options.backend != "jit" and devices > 1 and options.has_state and not options.sync_batchnorm:
        return "per-device statistics"
    n, m = split_of(options, devices)
    if n * m > 1:
        return None
    return "global view" if options.backend == "jit" else "one device"


def part_rows(rows: int, micro: int, k: int) -> np.ndarray:
    """Indices of `micro` parts of k rows each among `rows`: part m from the m-th micro-th of them."""
    stride = max(1, rows // micro)
    return np.array([(m * stride + i) % rows for m in range(micro) for i in range(k)])


def depends_on(fn, arg) -> bool:
    """Whether any output of fn(arg) depends on `arg`: a forward walk over its jaxpr (an equation that takes
    a dependent value makes all its outputs dependent: conservative for sub-programs)."""
    closed = jax.make_jaxpr(fn)(arg)
    tainted = set(closed.jaxpr.invars)
    for eqn in closed.jaxpr.eqns:
        if any(isinstance(v, jex.core.Var) and v in tainted for v in eqn.invars):
            tainted.update(eqn.outvars)
    return any(isinstance(v, jex.core.Var) and v in tainted for v in closed.jaxpr.outvars)


class Trace:
    """What tracing the loss showed: weighted, its dtype, its aux paths, whether it is random, and the
    (devices, micro-batches) split audited."""
    split = (1, 1)
    weighted = None
    dtype = jnp.float32
    aux = ()
    random = False


def batch_statistics(loss, params, model_state, rows, key) -> bool:
    """Whether the new model state the loss returns depends on its rows (BatchNorm's statistics): then
    each micro-batch legitimately has its own, and only the devices are audited."""
    if not jax.tree.leaves(model_state):
        return False
    return depends_on(lambda r: jax.tree.leaves(loss(params, model_state, r, key)[1][1]), rows)


def evaluations(loss, view, split, k: int, axis, needs_rng: bool, seen: Trace, explicit: bool = False):
    """The audit's function (per device, or on global arrays when `axis` is None): a dict of the
    evaluated values, each a float32 vector (the loss, then the plain aux leaves), the same everywhere."""
    def run(params, model_state, batch, rng, micro_step):
        if explicit:  # a sharding is part of the type there: rows are taken from a whole copy
            batch = jax.tree.map(lambda x: jax.sharding.reshard(x, P()), batch)
        key = jax.random.fold_in(rng, micro_step)  # one key on every device and for every call
        p = view(params)
        rows = jax.tree.leaves(batch)[0].shape[0]
        n, m = split
        if m > 1 and batch_statistics(loss, p, model_state, jax.tree.map(lambda x: x[:k], batch), key):
            m = 1
        seen.split = (n, m)
        own = jax.tree.map(lambda x: x[part_rows(rows, m, k)], batch)  # this device's m parts, (m·k, ...)
        whole = own if axis is None else jax.tree.map(lambda x: lax.all_gather(x, axis, tiled=True), own)
        parts = jax.tree.map(lambda x: x.reshape(m, k, *x.shape[1:]), own)

        def value(rows_, key_):
            total, (aux, _, weight) = loss(p, model_state, rows_, key_)
            seen.weighted, seen.dtype = weight is not None, total.dtype
            paths, leaves = zip(*jax.tree_util.tree_leaves_with_path(aux)) if jax.tree.leaves(aux) else ((), ())
            seen.aux = tuple(jax.tree_util.keystr(q) for q in paths)
            return jnp.stack([jnp.asarray(v, jnp.float32).reshape(()) for v in (total, *leaves)])

        first = jax.tree.map(lambda x: x[0], parts)
        seen.random = needs_rng and depends_on(lambda key_: value(first, key_), key)
        many = jax.vmap(value, in_axes=(0, None))  # one traced loss per shape
        out = {"whole": value(whole, key), "parts": many(parts, key).mean(0)}
        if n > 1 and m > 1 and not seen.random:  # where it fails (dropout would blur a third shape)
            out["devices"] = value(own, key)
        if seen.random:
            out.update(_same_shape(many, whole, parts, key, n * m, k, m, axis))
        return out if axis is None else jax.tree.map(lambda x: lax.pmean(x, axis), out)

    return run


def _same_shape(many, whole, parts, key, p: int, k: int, m: int, axis):
    """With dropout: the P rotations of W (this device's m of them) and each of its parts repeated P
    times, all on P·k rows with one key: each row meets the same masks both ways."""
    first = 0 if axis is None else lax.axis_index(axis) * m
    doubled = jax.tree.map(lambda x: jnp.concatenate([x, x]), whole)
    rotated = jax.tree.map(lambda x: jnp.stack([lax.dynamic_slice_in_dim(x, (first + j) * k, p * k)
                                                for j in range(m)]), doubled)
    repeated = jax.tree.map(lambda x: jnp.concatenate([x] * p, axis=1), parts)
    both = many(jax.tree.map(lambda a, b: jnp.concatenate([a, b]), rotated, repeated), key)
    return {"rotated": both[:m].mean(0), "repeated": both[m:].mean(0)}


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
    """Run the audit on the placed (micro-)batch `placed` with the step's `state` (in its layout).

    `loss(params, model_state, batch, key) -> (total, (aux, model_state, weight))`: the step's loss as
    declared, called with `audited_options`. Returns the `Audit`; a weighted loss is only traced
    (nothing compiled). On the first call (`first_call`), a loss that fails on the audit's rows is
    left to fail in the step itself, with the step's own message for its own shapes ("loss failed").
    """
    reason = skip_reason(options, layout.num_devices)
    if reason is not None:
        return Audit(float("nan"), float("nan"), 0, reason)
    split = split_of(options, layout.num_devices)
    global_view = getattr(layout, "global_view", False)
    rows = jax.tree.leaves(placed)[0].shape[0] if global_view else \
        jax.tree.leaves(layout.device_batch(placed))[0].shape[0]
    k = max(1, min(AUDIT_ROWS, rows // split[1]))
    explicit = global_view and layout.explicit
    if explicit and split[1] * layout.group <= rows:  # parts the model's own batch sharding divides
        k = layout.group
    seen = Trace()
    run = evaluations(loss, params_view(layout), split, k, None if global_view else layout.axis, options.needs_rng,
                      seen, explicit)
    args = (state.params, state.model_state, placed, state.rng, state.micro_step)
    try:
        lowered = _lowered(run, layout, mesh, state, args, global_view)
    except Exception:
        if not first_call:
            raise
        return Audit(float("nan"), float("nan"), k, "loss failed")
    if seen.weighted:  # seen while lowering: nothing is compiled for a loss that carries its weight
        return Audit(float("nan"), float("nan"), k, "weighted")
    split = seen.split
    if split[0] * split[1] == 1:  # one device, its micro-batches each with their own batch statistics
        return Audit(float("nan"), float("nan"), k, "micro-batch statistics")
    out = jax.device_get(lowered.compile()(*args))
    values = {name: np.asarray(v).reshape(-1, np.shape(v)[-1])[0] for name, v in out.items()}
    parts = split[0] * split[1]
    judged = partial(judge, values, parts, tolerance(seen.dtype), split, seen.random)
    verdict, kind, where, gathered, own, ratio = judged()
    for i, name in enumerate(seen.aux, start=1):  # aux is a report: named once, never refused
        aux = judged(i)
        if aux[0] == "refused":
            say_once(aux_note(name, float(values["whole"][i]), float(values["parts"][i]), parts))
    return Audit(gathered, own, k, verdict, parts, kind, where, ratio, split[1])


def _lowered(run, layout, mesh, state, args, global_view: bool):
    """The audit's program, lowered (which traces the loss): jit on global arrays, pmap, or shard_map."""
    if global_view:
        return jax.jit(run).lower(*args)
    axis = layout.axis
    if state.stacked:
        return jax.pmap(run, axis_name=axis, devices=list(mesh.devices.flat)).lower(*args)
    specs = layout._specs
    mapped = jax.shard_map(run, mesh=mesh, in_specs=(specs.params, specs.model_state, P(data_axes(mesh)), P(), P()),
                           out_specs=P(), check_vma=False)
    return jax.jit(mapped).lower(*args)
