"""`jdp explain`'s bf16 gradient communication: what `reduce_dtype="bfloat16"` costs in params.

The deviation matrix's problem (`jdp.inspect.explain_common.Problem`: MLP 8-16-4, global batch 32, K = 3 steps),
trained by jdp's step on N fake CPU devices with the gradient all-reduced in bfloat16, against ONE
float32 device; beside it the same N with the all-reduce in float32 (the gradient's own dtype).
Forward and backward stay float32 here: only the communication changes.

What to expect: bf16 keeps 8 significant bits, so each value it carries is within 2^-8 (0.39%)
of the float32 one. Each device rounds its gradient to bf16 (dividing by N = 2, 4, 8 is exact)
and the sum is rounded once more, so a step's gradient is off by about 2^-8 of the local
gradients' size, and after K steps the params by about that fraction of how far they moved.
float32 communication is the one-device step up to float32 rounding (~1e-7). At N = 1 there is
no all-reduce, but jdp's step still casts the gradient to bf16 and back: that column is the
rounding alone.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from jdp.inspect.comm import parse_collectives
from jdp.inspect.explain_common import Problem, cached_step, matrix_specs, max_abs_diff, mlp_loss, table, train_problem

OPTIMIZERS = ("sgd", "adam")  # the matrix's specs, clipping off: a linear update and a normalised one
REDUCE_DTYPES = ("float32", "bfloat16")
BF16_UNIT_ROUNDOFF = 2.0 ** -8  # half a unit in the last place of bf16's 8 significant bits, relative


def _spec(optimizer: str):
    """The matrix's spec for `optimizer` with clipping off (the max-norm given only enters clipped ones)."""
    return matrix_specs(1.0)[(optimizer, False)]


def _reduce_dtype(name: str) -> str | None:
    # The gradients are float32, so reduce_dtype "float32" is the step with no cast at all (None):
    # the deviation matrix's compiled steps, reused rather than compiled again.
    return None if name == "float32" else name


def program_allreduce_bytes(n: int, reduce_dtype: str, problem: Problem, backend: str = "shard_map") -> int:
    """Bytes per device that the LOWERED step's all-reduces carry (gradient + loss), before any backend
    pass: the bf16 program sends half the gradient bytes even where the CPU later widens it to f32."""
    step = cached_step(mlp_loss, _spec("sgd"), "mean", None, n, backend, _reduce_dtype(reduce_dtype))
    batch = {**problem.batches[0], "scale": np.ones(len(problem.batches[0]["y"]), np.float32)}
    hlo = step.lower(step.init(problem.params), batch).as_text(dialect="hlo")
    return sum(c["bytes"] for c in parse_collectives(hlo) if c["kind"] == "all-reduce")


def bf16_communication(ns=(2, 4, 8), backend: str = "shard_map", problem: Problem | None = None,
                       optimizers=OPTIMIZERS, *, progress: Callable[[int, int, str], object] | None = None) -> dict:
    """max |Δparam| vs one float32 device, for optimizer × all-reduce dtype × N (bf16 also at N = 1).

    Returns plain data: `rows` ({optimizer, reduce_dtype, devices, max_abs_dparam, relative}, where
    relative = max_abs_dparam / movement), `movement` (per optimizer: max |param after K steps −
    initial param| of the one-device run, the scale of what training changed), `steps`,
    `program_allreduce_bytes` (at max N, per dtype) and `bf16_unit_roundoff` (2^-8).
    `progress(k, n, what)` is called as each optimizer × dtype, and the program's bytes, start.
    """
    problem = problem or Problem.make()
    tell = progress or (lambda k, total, what: None)
    items = len(optimizers) * len(REDUCE_DTYPES) + 1
    rows, movement = [], {}
    for i, name in enumerate(optimizers):
        spec = _spec(name)
        reference, _ = train_problem(problem, spec, "mean", None, 1, backend)  # the matrix's reference step
        movement[name] = max_abs_diff(reference, problem.params)
        for j, dtype in enumerate(REDUCE_DTYPES):
            counts = (1, *ns) if dtype == "bfloat16" else ns
            what = f"{name}, all-reduce in {dtype}, N = {', '.join(map(str, counts))}"
            tell(i * len(REDUCE_DTYPES) + j + 1, items, what)
            for n in counts:
                params, _ = train_problem(problem, spec, "mean", None, n, backend, reduce_dtype=_reduce_dtype(dtype))
                dev = max_abs_diff(params, reference)
                rows.append({"optimizer": name, "reduce_dtype": dtype, "devices": n, "max_abs_dparam": dev,
                             "relative": dev / movement[name]})
    n = max(ns)
    tell(items, items, f"the lowered program's all-reduce bytes at N = {n}")
    return {"steps": len(problem.batches), "rows": rows, "movement": movement, "bf16_unit_roundoff": BF16_UNIT_ROUNDOFF,
            "program_allreduce_bytes": {"devices": n, **{d: program_allreduce_bytes(n, d, problem, backend)
                                                         for d in REDUCE_DTYPES}}}


def _fmt(x: float) -> str:
    return "0" if x == 0 else f"{x:.1e}"


def _share(x: float) -> str:
    return f"{x:.2%}" if x >= 1e-4 else f"{x:.1e}"


def render_bf16_communication(section: dict, console) -> None:
    """Print `bf16_communication()`'s result as a rich table and one line on the program's bytes.

    One row per device count and one column per optimizer × dtype: more device counts make the
    table longer, not wider (it fits 80 columns, the width when piped)."""
    rows = section["rows"]
    ns = sorted({r["devices"] for r in rows})
    pairs = [(name, dtype) for name in dict.fromkeys(r["optimizer"] for r in rows) for dtype in REDUCE_DTYPES]
    by = {(r["optimizer"], r["reduce_dtype"], r["devices"]): r for r in rows}
    columns = [f"{name} {dtype}" for name, dtype in pairs]
    t = table(f"bf16 gradient communication: max |Δparam| vs one float32 device after {section['steps']} steps "
              "(reduce_dtype; forward and backward in float32)", "all-reduce over", *columns, right=tuple(columns))
    for n in ns:
        t.add_row(f"N={n}", *[_fmt(by[(*p, n)]["max_abs_dparam"]) if (*p, n) in by else "" for p in pairs])
    t.add_section()
    t.add_row("params moved", *[f"{section['movement'][name]:.3f}" for name, _ in pairs])
    t.add_row("worst / moved", *[_share(max(r["relative"] for k, r in by.items() if k[:2] == p)) for p in pairs])
    console.print(t)
    b = section["program_allreduce_bytes"]
    console.print(f"bf16 rounds each value to within {section['bf16_unit_roundoff']:.2%}; N=1 has no all-reduce, only "
                  f"jdp's cast to bf16 and back. The program's all-reduces at N={b['devices']}: {b['float32']} bytes "
                  f"(float32), {b['bfloat16']} (bfloat16); on CPU XLA widens bf16 all-reduces to f32 when it "
                  "compiles, GPUs send them as bf16.")
