"""The audit's verdict (`jdp.core.audit`): what its numbers mean, and the one sentence that refuses a loss.

The audit evaluates the loss on W, the concatenation of P equal parts (P = the devices the loss runs
on × the micro-batches it is called on), and on the parts. A mean over rows gives L(W) = mean_j
L(part_j) up to rounding. Two ways to fail are told apart by their size:

- scale: |log(L(W) / mean_j L(part_j))| > log(P)/2, as for a sum over rows or a division by a fixed
  count (`num_items_in_batch`): the ratio is ≈ P, which neither rounding nor dropout can fake;
- own count: the two differ by more than the tolerance of the dtype the loss returns, as for a loss
  divided by its own rows' count of tokens (`sum(l·w) / sum(w)`), a mean of per-part means.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

RTOL = 1e-4  # float32: both sides are sums of the same per-row values in two orders (~1e-7 measured)
ATOL = 1e-6  # a loss of ~0 differs by rounding that no fraction of it bounds
LOW_EPS = 4  # a loss returned in bfloat16/float16 is rounded once per value: a few eps of its dtype


class Audit(NamedTuple):
    """What the audit found. `gathered`: the loss of the P·k audited rows as one call (with dropout:
    the mean over the P rotations of those rows); `own`: the mean of its values on the P parts of k
    rows (with dropout: on each part repeated P times); `rows`: k; `verdict`: "commutes", "refused",
    or why nothing was compared: "weighted" (a `jdp.Weighted` loss), "global view" (backend="jit"
    without accumulation: the loss sees the whole batch), "one device" (one device without
    accumulation), "micro-batch statistics" (model state with accumulation on one device: each
    micro-batch has its own statistics), "per-device statistics" (`sync_batchnorm=False`), "not
    finite" (both NaN/Inf), "loss failed" (the first call's audit could not run the loss on its rows:
    the step then raises its own error). `parts`: P; `kind`: "sum or fixed divisor" or "own count"
    (refused) else ""; `where`: "devices", "micro-batches" or both (where the parts differ); `ratio`:
    gathered / (mean of the parts' values), the scale check's number; `micro`: the micro-batches among
    the P parts (1 where they are not audited: batch statistics in the model state)."""

    gathered: float
    own: float
    rows: int
    verdict: str
    parts: int = 0
    kind: str = ""
    where: str = ""
    ratio: float = float("nan")
    micro: int = 1


class AuditError(ValueError):
    """The audit's refusal of a loss that is not a mean over its rows; `audit` holds what it found."""

    def __init__(self, found: Audit, devices: int, options):
        super().__init__(refusal(found, devices, options))
        self.audit = found


def tolerance(dtype) -> float:
    """The relative tolerance for a loss returned in `dtype`: RTOL, or LOW_EPS eps of a 16-bit float."""
    dtype = np.dtype(dtype)
    return RTOL if dtype.itemsize >= 4 else max(RTOL, LOW_EPS * float(np.finfo(dtype).eps))


def close(a: float, b: float, rtol: float) -> bool:
    return abs(a - b) <= rtol * max(abs(a), abs(b)) + ATOL


def scale_ratio(whole: float, parts: float) -> float:
    """whole / parts where both are finite, nonzero and of one sign, else NaN (no scale to compare)."""
    if not (np.isfinite(whole) and np.isfinite(parts)) or whole * parts <= 0:
        return float("nan")
    return whole / parts


def off_scale(ratio: float, parts: int) -> bool:
    """A ratio no mean over rows gives: |log ratio| > log(P)/2 (a sum or a fixed divisor gives ≈ P)."""
    return parts > 1 and np.isfinite(ratio) and abs(math.log(ratio)) > math.log(parts) / 2


def judge(values: dict, parts: int, rtol: float, split: tuple[int, int], random: bool, i: int = 0) -> tuple:
    """`(verdict, kind, where, gathered, own, ratio)` for entry `i` of the evaluated `values` (0: the loss;
    then aux leaves). `values`: "whole" (L(W)), "parts" (mean_j L(part_j)), "devices" (mean over the
    devices of L(device's rows), when both dimensions are split), and with dropout "rotated" and
    "repeated" (P·k rows each, one key). `split`: (devices, micro-batches) the P parts come from."""
    whole, own = float(values["whole"][i]), float(values["parts"][i])
    ratio = scale_ratio(whole, own)
    if random:  # the same-shape comparison, exact under dropout for own counts
        whole_same, own_same = float(values["rotated"][i]), float(values["repeated"][i])
    else:
        whole_same, own_same = whole, own
    finite = np.isfinite([whole, own, whole_same, own_same])
    if not finite.any():
        return "not finite", "", "", whole_same, own_same, ratio
    if off_scale(ratio, parts):
        return "refused", "sum or fixed divisor", where_split(split), whole, own, ratio
    if finite.all() and close(whole_same, own_same, rtol):
        return "commutes", "", "", whole_same, own_same, ratio
    where = where_split(split)
    if "devices" in values and finite.all():
        dev = float(values["devices"][i])
        where = where_split((split[0] if not close(whole, dev, rtol) else 1, split[1] if not close(dev, own, rtol)
                             else 1)) or where
    return "refused", "own count", where, whole_same, own_same, ratio


def where_split(split: tuple[int, int]) -> str:
    devices, micro = split
    return " and ".join(name for name, n in (("devices", devices), ("micro-batches", micro)) if n > 1)


def _parts(found: Audit, split: tuple[int, int]) -> str:
    devices, micro = split
    if devices > 1 and micro > 1:
        return f"the {found.parts} parts the step makes ({devices} devices × {micro} micro-batches)"
    return f"the {devices} devices" if devices > 1 else f"the {micro} micro-batches"


def refusal(found: Audit, devices: int, options) -> str:
    """The one sentence that refuses a loss which is not a mean over its rows: what was found, the two
    numbers, where, and the fixes (backend='jit' only where it would fix it)."""
    split = (found.parts // found.micro, found.micro)
    masked = options.mask_key not in (None, "auto")
    own = found.where.replace("devices", "device").replace("micro-batches", "micro-batch")
    rows = f"on {found.parts * found.rows} rows, {found.rows} from each of {_parts(found, split)}"
    if found.kind == "sum or fixed divisor":
        what = (f"{rows}, its value as one call is {found.gathered:.7g}, {found.ratio:.3g}× the mean of its values on "
                f"the parts ({found.own:.7g}), as for a sum over rows or a division by a fixed count (such as "
                f"num_items_in_batch), so the step would depend on how the batch is split")
    else:
        cause = (f"a mask_key loss normalised by sum(mask) on each {own}'s rows (under mask_key jdp expects "
                 f"sum(mask·l)/b and divides by the real count itself)" if masked else
                 f"a loss that divides by each {own}'s own count of tokens")
        what = (f"{rows}, its value as one call is {found.gathered:.7g} but the mean of its values on the parts is "
                f"{found.own:.7g}, as for {cause}, so the step would follow a mean of per-{own} means")
    fixes = ("return sum(mask·l)/b, or jdp.Weighted(sum(mask·l), sum(mask)) (jdp divides by the global count once)"
             if masked and found.kind == "own count" else
             "return jdp.Weighted(sum of the losses, their count) (jdp divides by the global count once)")
    # jit fixes it only where the loss would then see the whole batch: no accumulation, not already jit, no mask_key
    if options.backend != "jit" and options.accum_steps == 1 and not masked:
        fixes += " or use backend='jit' (the loss sees the whole batch)"
    return (f"loss_fn is not a mean over its rows: {what}, not one device's step on the whole batch: {fixes}, "
            f"or pass audit=False to train it as it is.")


def aux_note(name: str, gathered: float, own: float, parts: int) -> str:
    """The line said once for an aux value that is not a mean over its rows (jdp trains on; aux is a report)."""
    return (f"aux{name} is not a mean over its rows (a count or a sum?): its value on the audited rows as one "
            f"call is {gathered:.7g}, the mean of its values on the {parts} parts {own:.7g}; jdp averages aux "
            f"over devices and micro-batches, so return it as jdp.Weighted(sum, count) or as a mean.")
