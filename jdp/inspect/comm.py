"""What a compiled step communicates: its collectives (all-reduce, reduce-scatter, all-gather), read
from its HLO, per optimizer step."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_SHAPE = re.compile(r"\b(pred|[subfc]\d+|bf16)\[([\d,]*)\]")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_BRANCHES = re.compile(r"(?:branch_computations=\{([^}]*)\}|true_computation=%?([\w.\-]+), "
                       r"false_computation=%?([\w.\-]+))")


KINDS = ("all-reduce", "reduce-scatter", "all-gather")
# Ring traffic each device sends, as a multiple of the full payload P: a reduce-scatter sends N−1
# chunks of P/N, an all-gather N−1 chunks of P/N, an all-reduce both (it is one of each).
_RING = {"all-reduce": lambda n: 2 * (n - 1) / n, "reduce-scatter": lambda n: (n - 1) / n,
         "all-gather": lambda n: (n - 1) / n}


@dataclass(frozen=True)
class Collective:
    """One collective instruction of the compiled step."""

    kind: str  # one of KINDS
    computation: str  # the HLO computation that holds it
    runs: str  # "every call", or "update only" (inside the branch that applies the update)
    bytes: int  # full payload per device per execution: the all-reduced value, the reduce-scatter's
    #             input (N slices), the all-gather's output (N slices)
    executions_per_update: int  # how often it runs per optimizer step
    carries_gradients: bool  # its payload holds the whole gradient (>= the gradient's bytes)
    widened: bool = False  # the program sends bf16; this backend (CPU) widened it to f32
    group: int | None = None  # devices in each of its replica groups; None: every device of the step
    #                           (hybrid sharding: a group's devices, or one device of each group)
    loop_trips: int | None = 1  # times it runs per call: the trip counts of the while loops around it
    #                             (a scan's body: once per layer) multiplied; 1 outside any loop; None
    #                             inside a loop whose trip count the compiled HLO does not state

    @property
    def in_loop(self) -> bool:
        """Whether it sits inside a while loop's body (a `lax.scan`, `nnx.scan`, `nn.scan`): per-layer
        FSDP's gathers and reduce-scatters do, once per layer; the whole model's gather does not."""
        return self.loop_trips != 1

    def ring_bytes(self, n: int) -> float:
        """Bytes each device sends for one execution in a ring over its group (`n`: the step's
        devices, the group when `group` is None)."""
        return _RING[self.kind](self.group or n) * self.bytes


AllReduce = Collective  # the name before reduce-scatter and all-gather were reported


@dataclass(frozen=True)
class CommReport:
    """Collective traffic of one optimizer step (accum_steps calls) of a `TrainStep`."""

    devices: int
    accum_steps: int
    accum_sync: str
    gradient_bytes: int  # bytes of one full gradient as communicated (in reduce_dtype, if set)
    collectives: list[Collective] = field(default_factory=list)

    @property
    def allreduces(self) -> list[Collective]:
        return [c for c in self.collectives if c.kind == "all-reduce"]

    def of_kind(self, kind: str) -> list[Collective]:
        return [c for c in self.collectives if c.kind == kind]

    @property
    def gradient_allreduces_per_update(self) -> int:
        """Executions of all-reduces carrying the gradient, per optimizer step."""
        return sum(a.executions_per_update for a in self.allreduces if a.carries_gradients)

    @property
    def bytes_per_update(self) -> int:
        """Full payload bytes of every collective, per device per optimizer step."""
        return sum(c.bytes * c.executions_per_update for c in self.collectives)

    @property
    def ring_bytes_per_device(self) -> float:
        """Ring traffic each device sends per optimizer step: 2(N−1)/N · bytes for an all-reduce
        (N−1 reduce-scatter chunks, then N−1 all-gather chunks, of bytes/N each), (N−1)/N · bytes
        for a reduce-scatter or an all-gather, N the devices of the collective's group (hybrid
        sharding: the G devices of a replica group, or the R groups' copies of a block)."""
        return sum(c.ring_bytes(self.devices) * c.executions_per_update for c in self.collectives)

    def __str__(self) -> str:
        scattered = sum(c.executions_per_update for c in self.of_kind("reduce-scatter"))
        gradient = (f"{scattered} gradient reduce-scatter(s) and "
                    f"{sum(c.executions_per_update for c in self.of_kind('all-gather'))} params all-gather(s)"
                    if scattered else f"{self.gradient_allreduces_per_update} gradient all-reduce(s)")
        lines = [f"{self.devices} devices, accum_steps={self.accum_steps}, accum_sync={self.accum_sync!r}: "
                 f"{gradient} per optimizer step, "
                 f"{self.bytes_per_update:,} bytes, ring traffic {self.ring_bytes_per_device:,.0f} bytes/device "
                 f"(gradient = {self.gradient_bytes:,} bytes)"]
        for c in self.collectives:
            loop = "" if not c.in_loop else f", inside a loop ({c.loop_trips or 'an unstated number of'} times per call)"
            lines.append(f"  {c.kind} in {c.computation}" + (f" (groups of {c.group})" if c.group else "")
                         + f": {c.bytes:,} bytes, runs {c.runs}{loop}, "
                         f"×{c.executions_per_update} per optimizer step" + (" (gradient)" if c.carries_gradients else "")
                         + (" (bf16 in the program; this backend's collectives widen it to f32)" if c.widened else ""))
        return "\n".join(lines)


def _shape_bytes(text: str) -> int:
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        total += _DTYPE_BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
    return total


_OP = re.compile(r"=\s*(.*?)\s+(all-reduce|reduce-scatter|all-gather)(?:-start)?\((.*)$")


_CALLS = re.compile(r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)"
                    r"|branch_computations=\{([^}]*)\}")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def _loop_trips(hlo: str) -> dict[str, int | None]:
    """{computation: the times it runs per call of the program}: 1 for the entry computation and what
    it calls, a while body's count times its caller's (None where a loop's count is not stated)."""
    calls, entry, computation = {}, None, None  # calls: {computation: [(callee, trips of that call)]}
    for line in hlo.splitlines():
        header = _HEADER.match(line)
        if header and not line.startswith(" "):
            computation = header.group(1)
            entry = computation if line.startswith("ENTRY") else entry
            calls[computation] = []
            continue
        body = re.search(r"\bwhile\(.*?\bbody=%?([\w.\-]+)", line)
        trips = _TRIPS.search(line)
        for m in _CALLS.finditer(line):
            for name in (m.group(1).split(",") if m.group(1) else m.group(2).split(",")):
                name = name.strip().lstrip("%")
                looped = body is not None and name == body.group(1)
                calls[computation].append((name, (int(trips.group(1)) if trips else None) if looped else 1))
    times = {}

    def visit(name, n):
        if name in times and times[name] == n:
            return
        times[name] = n
        for callee, k in calls.get(name, []):
            visit(callee, None if n is None or k is None else n * k)

    if entry is not None:
        visit(entry, 1)
    return times


def parse_collectives(hlo: str) -> list[dict]:
    """Each collective in the HLO text `hlo`: kind, computation, whether it sits in a conditional
    branch, how often it runs per call (`loop_trips`: the trip counts of the while loops around it,
    1 outside any, None where a count is not stated), full payload bytes (see `Collective.bytes`),
    whether the backend widened it, and the devices in each of its replica groups (None where the
    HLO does not say)."""
    computation, found, branches, trips = None, [], set(), _loop_trips(hlo)
    for line in hlo.splitlines():
        header = _HEADER.match(line)
        if header and not line.startswith(" "):
            computation = header.group(1)
            continue
        for m in _BRANCHES.finditer(line):
            names = m.group(1).split(",") if m.group(1) else [m.group(2), m.group(3)]
            branches.update(n.strip().lstrip("%") for n in names)
        op = _OP.search(line)
        if op:
            result, kind, rest = op.groups()
            nbytes = _shape_bytes(result)
            group = _group_size(rest)
            if kind == "reduce-scatter":  # the result is one slice: the payload is N of them
                nbytes *= group or 1
            found.append({"kind": kind, "computation": computation, "bytes": nbytes,
                          "widened": "_promoted" in rest, "group": group})
    for f in found:
        f["in_branch"] = f["computation"] in branches
        f["loop_trips"] = trips.get(f["computation"], 1)
    return found


def _group_size(attrs: str) -> int | None:
    """Devices in the first replica group of an HLO collective (`replica_groups={{0,1,2,3},...}`
    or the iota form `replica_groups=[1,4]<=[4]`); None if it names none."""
    m = re.search(r"replica_groups=\{\{([\d,]+)\}", attrs)
    if m:
        return len(m.group(1).split(","))
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]", attrs)
    return int(m.group(2)) if m else None


def parse_allreduces(hlo: str) -> list[tuple[str, bool, int]]:
    """`(computation, inside a conditional branch, payload bytes)` for each all-reduce in `hlo`."""
    return [(c["computation"], c["in_branch"], c["bytes"]) for c in parse_collectives(hlo) if c["kind"] == "all-reduce"]


def comm_report(step, state, batch) -> CommReport:
    """Read the compiled `step` for (state, batch) and report its collectives per optimizer step.

    A collective in the step's main computation runs on every call, i.e. `accum_steps` times per
    optimizer step; one inside a conditional branch runs only on the call that applies the update;
    one inside a while loop's body (a scan over layers) runs once per iteration, and says so
    (`Collective.in_loop`, `loop_trips`): per-layer FSDP's gathers and reduce-scatters are there.
    On CPU, XLA widens bf16 collectives to f32 (its collectives have no bf16): those are reported
    with their f32 bytes and marked `widened`; GPUs send them as bf16.
    """
    hlo = step.lower(state, batch).compile().as_text()
    params = jax.tree.leaves(state.params)  # every layout keeps the params' own shapes
    per_copy = [x.shape[1:] if state.stacked else x.shape for x in params]
    sent = step.options.reduce_dtype
    itemsize = lambda x: np.dtype(sent).itemsize if sent and jnp.issubdtype(x.dtype, jnp.floating) else x.dtype.itemsize  # noqa: E731
    grad_bytes = int(sum(np.prod(s, dtype=np.int64) * itemsize(x) for s, x in zip(per_copy, params)))
    collectives = [Collective(kind=c["kind"], computation=c["computation"],
                              runs="update only" if c["in_branch"] else "every call", bytes=c["bytes"],
                              executions_per_update=(1 if c["in_branch"] else step.accum_steps) * (c["loop_trips"] or 1),
                              loop_trips=c["loop_trips"],
                              carries_gradients=c["kind"] == "all-reduce" and c["bytes"] >= grad_bytes,
                              widened=c["widened"], group=None if c["group"] == step.num_devices else c["group"])
                   for c in parse_collectives(hlo)]
    return CommReport(step.num_devices, step.accum_steps, step.accum_sync, grad_bytes, collectives)
