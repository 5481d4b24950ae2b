"""What a compiled step communicates: all-reduces read from its HLO, per optimizer step."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import jax
import numpy as np

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_SHAPE = re.compile(r"\b(pred|[subfc]\d+|bf16)\[([\d,]*)\]")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_BRANCHES = re.compile(r"(?:branch_computations=\{([^}]*)\}|true_computation=%?([\w.\-]+), "
                       r"false_computation=%?([\w.\-]+))")


@dataclass(frozen=True)
class AllReduce:
    """One all-reduce instruction of the compiled step."""

    computation: str  # the HLO computation that holds it
    runs: str  # "every call", or "update only" (inside the branch that applies the update)
    bytes: int  # payload per device per execution
    executions_per_update: int  # how often it runs per optimizer step
    carries_gradients: bool  # its payload holds the whole gradient (>= the params' bytes)


@dataclass(frozen=True)
class CommReport:
    """All-reduce traffic of one optimizer step (accum_steps calls) of a `TrainStep`."""

    devices: int
    accum_steps: int
    accum_sync: str
    gradient_bytes: int  # bytes of one full gradient (= the params)
    allreduces: list[AllReduce] = field(default_factory=list)

    @property
    def gradient_allreduces_per_update(self) -> int:
        """Executions of all-reduces carrying the gradient, per optimizer step."""
        return sum(a.executions_per_update for a in self.allreduces if a.carries_gradients)

    @property
    def bytes_per_update(self) -> int:
        """All-reduce payload bytes per device per optimizer step."""
        return sum(a.bytes * a.executions_per_update for a in self.allreduces)

    @property
    def ring_bytes_per_device(self) -> float:
        """Ring all-reduce traffic each device sends per optimizer step: in a ring all-reduce each device
        sends 2(N−1)/N · bytes (N−1 reduce-scatter chunks, then N−1 all-gather chunks, of bytes/N each)."""
        n = self.devices
        return 2 * (n - 1) / n * self.bytes_per_update

    def __str__(self) -> str:
        lines = [f"{self.devices} devices, accum_steps={self.accum_steps}, accum_sync={self.accum_sync!r}: "
                 f"{self.gradient_allreduces_per_update} gradient all-reduce(s) per optimizer step, "
                 f"{self.bytes_per_update:,} bytes, ring traffic {self.ring_bytes_per_device:,.0f} bytes/device "
                 f"(gradient = {self.gradient_bytes:,} bytes)"]
        for a in self.allreduces:
            lines.append(f"  all-reduce in {a.computation}: {a.bytes:,} bytes, runs {a.runs}, "
                         f"×{a.executions_per_update} per optimizer step"
                         + (" (gradient)" if a.carries_gradients else ""))
        return "\n".join(lines)


def _shape_bytes(text: str) -> int:
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        total += _DTYPE_BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
    return total


def parse_allreduces(hlo: str) -> list[tuple[str, bool, int]]:
    """`(computation, inside a conditional branch, payload bytes)` for each all-reduce in `hlo`."""
    computation, found, branches = None, [], set()
    for line in hlo.splitlines():
        header = _HEADER.match(line)
        if header and not line.startswith(" "):
            computation = header.group(1)
            continue
        for m in _BRANCHES.finditer(line):
            names = m.group(1).split(",") if m.group(1) else [m.group(2), m.group(3)]
            branches.update(n.strip().lstrip("%") for n in names)
        op = re.search(r"=\s*(.*?)\s+all-reduce(?:-start)?\(", line)
        if op:
            found.append((computation, op.group(1)))
    return [(comp, comp in branches, _shape_bytes(shape)) for comp, shape in found]


def comm_report(step, state, batch) -> CommReport:
    """Read the compiled `step` for (state, batch) and report its all-reduces per optimizer step.

    An all-reduce in the step's main computation runs on every call, i.e. `accum_steps` times per
    optimizer step; one inside a conditional branch runs only on the call that applies the update.
    """
    hlo = step.lower(state, batch).compile().as_text()
    params = jax.tree.leaves(state.params)
    per_copy = [x.shape[1:] if state.stacked else x.shape for x in params]
    grad_bytes = int(sum(np.prod(s, dtype=np.int64) * x.dtype.itemsize for s, x in zip(per_copy, params)))
    allreduces = [AllReduce(computation=comp, runs="update only" if in_branch else "every call", bytes=nbytes,
                            executions_per_update=1 if in_branch else step.accum_steps,
                            carries_gradients=nbytes >= grad_bytes)
                  for comp, in_branch, nbytes in parse_allreduces(hlo)]
    return CommReport(step.num_devices, step.accum_steps, step.accum_sync, grad_bytes, allreduces)
