"""benchmarks/gpu_check.sh's report: its parts' results (plain data) as one markdown document.

Every section says how its part ended; a part that failed or ran out of time shows the end of its
output and whatever it measured before. The raw results follow as JSON at the end.
"""
from __future__ import annotations

import json


def _num(x, fmt: str = "{:,.1f}", none: str = "n/a") -> str:
    return none if x is None else fmt.format(x)


def _share(x: float) -> str:
    return f"{x:.2%}" if x >= 1e-4 else f"{x:.1e}"


def _table(head: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(map(str, r)) + " |"
                                                                          for r in rows]


def _status(part: dict | None) -> list[str]:
    """A part's ending in one line, plus the end of its output where it did not succeed."""
    if part is None:
        return ["_not run_", ""]
    lines = [f"_{part['status']}" + (f", {part['seconds']} s_" if "seconds" in part else "_"), ""]
    if part.get("output_tail", "").strip():
        lines += ["```", part["output_tail"].strip()[-2000:], "```", ""]
    return lines


def _env(part: dict | None) -> list[str]:
    r = (part or {}).get("result") or {}
    lines = ["## Machine", ""] + _status(part)
    if r:
        lines += [f"- backend **{r['backend']}**, devices: {', '.join(r['devices'])}",
                  f"- device kind `{r['device_kind']}`, peak bf16 FLOP/s (jdp.run.metrics.peak_flops): "
                  f"{_num(r['peak_flops_per_device'], '{:.3g}')}, memory limit "
                  f"{_num(r['memory_limit_bytes'], '{:,}')} B",
                  f"- Python {r['python']}; " + ", ".join(f"{k} {v}" for k, v in r["versions"].items()),
                  f"- default matmul precision: {r['matmul_precision']}; env: {r['env']}", ""]
    return lines


def _tests(part: dict | None) -> list[str]:
    r = (part or {}).get("result") or {}
    lines = ["## (a) Tests that need one device, on the device", ""] + _status(part)
    if r:
        lines += [f"JDP_TEST_PLATFORM={r['platform']}, JAX_DEFAULT_MATMUL_PRECISION={r['matmul_precision']} "
                  "(the tests' float32 tolerances assume IEEE float32 matmuls, not TF32).", ""]
        rows = [[f"`{f['file']}`" + (f" -k `{f['select']}`" if f["select"] else ""), f.get("passed", 0),
                 f.get("failed", 0), f.get("error", 0), f.get("skipped", 0), _num(f.get("seconds")), f["status"]]
                for f in r["files"]]
        total = {k: sum(f.get(k, 0) for f in r["files"]) for k in ("passed", "failed", "error", "skipped")}
        lines += _table(["file", "passed", "failed", "errors", "skipped", "s", "status"],
                        rows + [["**total**", *total.values(), "", ""]])
        lines += [""] + [f"- {line}" for f in r["files"] for line in f.get("failures", [])] + [""]
    return lines


def _bench_row(label: str, b: dict) -> list:
    return [label, b["global_batch"], _num(b["median_step_s"] * 1e3), _num(b["tokens_per_s"], "{:,.0f}"),
            _num(b["mfu"], "{:.1%}"), _num(b["compile_s"]), _num(b.get("peak_memory_bytes") and
                                                                   b["peak_memory_bytes"] / 2**30, "{:.1f}")]


_BENCH_HEAD = ["run", "global batch", "step ms", "tokens/s", "MFU", "compile s", "peak GiB (process)"]


def _throughput(part: dict | None) -> list[str]:
    r = (part or {}).get("result") or {}
    lines = ["## (b) GPT throughput: float32 vs bfloat16 (jdp's step, `precision=`)", ""] + _status(part)
    if r:
        m = next(iter(r.values()))["model"]
        lines += [f"Model: {m['params']:,} params, d_model {m['d_model']}, {m['n_layers']} layers, {m['n_heads']} "
                  f"heads, context {m['context']}, vocab {m['vocab']}, attention {m['attention']}, remat {m['remat']}; "
                  "AdamW, float32 master params. MFU against the bf16 dense peak for both rows; float32 matmuls "
                  f"ran at matmul precision `{next(iter(r.values()))['matmul_precision']}`.", ""]
        lines += _table(_BENCH_HEAD, [_bench_row(p, b) for p, b in r.items()])
        if {"float32", "bfloat16"} <= set(r):
            ratio = r["bfloat16"]["tokens_per_s"] / r["float32"]["tokens_per_s"]
            lines += ["", f"bfloat16 / float32 tokens/s: **{ratio:.2f}x**"]
        lines.append("")
    return lines


def _largest(part: dict | None) -> list[str]:
    r = (part or {}).get("result") or {}
    lines = ["## (c) Largest global batch that fits, bfloat16", ""] + _status(part)
    for key, s in r.items():
        tries = ", ".join(f"{t['batch']}: {t['outcome']} ({t['seconds']} s)" for t in s["tries"]) or "none finished"
        lines += [f"- **{key}**: tried {s['candidates']} largest first: {tries}"]
        if "global_batch" in s:
            note = "" if s["oom_batches"] else " (the largest candidate: the limit may be higher)"
            lines += [f"  - fits: **{s['global_batch']}** windows of {s['model']['context']} tokens{note}"]
    fitted = [(k, s) for k, s in r.items() if "global_batch" in s]
    if fitted:
        lines += [""] + _table(_BENCH_HEAD, [_bench_row(k, s) for k, s in fitted])
    return lines + [""]


def _exactness(part: dict | None) -> list[str]:
    r = (part or {}).get("result") or {}
    lines = ["## (d) Exactness of bf16 on the device (one device)", ""] + _status(part)
    if r:
        lines += [f"{r['problem']} on `{r['device']}`: max |Δparam| after 3 steps against float32 on the same "
                  "device (matmul precision highest) and against float32 on the CPU; `moved` is how far the "
                  "params moved. With one device there is no cross-device all-reduce.", ""]
        rows = [[k, _num(v.get("vs_float32_here"), "{:.1e}", ""), _num(v["vs_float32_cpu"], "{:.1e}"),
                 _num(v["moved"], "{:.3f}")] for k, v in r["runs"].items()]
        lines += _table(["(i) run", "vs float32 here", "vs float32 CPU", "moved"], rows) + [""]
        for k, v in r["runs"].items():
            if "hlo" in v:
                h = v["hlo"]
                lines += [f"- (ii) {k}: the program has {h['program_allreduces']} all-reduce(s) and "
                          f"{h['program_bf16_values']} bf16 values; the compiled step has "
                          f"{len(h['compiled_allreduces'])} all-reduce(s) {h['compiled_allreduces']} and "
                          f"{h['compiled_bf16_values']} bf16 values (0: the compiler removed the bf16 round trip)."]
        lines.append("")
    return lines


def _cpu_bf16(part: dict | None) -> list[str]:
    r = (part or {}).get("result") or {}
    lines = ["## (d iii) jdp explain's bf16 gradient communication — on fake CPU devices, not the GPU", ""]
    lines += _status(part)
    if r:
        ns = sorted({row["devices"] for row in r["rows"]})
        rows = []
        for opt in r["movement"]:
            for dtype in ("float32", "bfloat16"):
                mine = {x["devices"]: x for x in r["rows"] if (x["optimizer"], x["reduce_dtype"]) == (opt, dtype)}
                rows.append([opt, dtype, *[_num(mine[n]["max_abs_dparam"], "{:.1e}") if n in mine else "" for n in ns],
                             _share(max(x["relative"] for x in mine.values()))])
        lines += [f"max |Δparam| vs one float32 device after {r['steps']} steps ({r['platform']}, "
                  f"{r['seconds']} s):", ""]
        lines += _table(["optimizer", "all-reduce in", *[f"N={n}" for n in ns], "worst / moved"], rows)
        b = r["program_allreduce_bytes"]
        lines += ["", f"Program all-reduce bytes at N={b['devices']}: float32 {b['float32']}, bfloat16 {b['bfloat16']} "
                  "(the CPU widens bf16 all-reduces to f32 when it compiles).", ""]
    return lines


def _fsdp(part: dict | None) -> list[str]:
    r = (part or {}).get("result") or {}
    lines = ["## (e) Replicated / ZeRO-1 / FSDP as XLA's compiler builds them (compiled, not run)", ""]
    lines += _status(part)
    for n, runs in r.get("runs", {}).items():
        m = runs["model"]
        lines += [f"Backend {r['backend']}, N = {n} ({', '.join(r['devices'][:2])}, ...): GPT {m['params']:,} params, "
                  f"{m['n_layers']} layers, d_model {m['d_model']}, {m['per_device']} windows of {m['context']} "
                  f"tokens per device, bf16 compute, AdamW, remat {m['remat']}. Bytes per device from XLA's memory "
                  f"analysis; collectives of the compiled program (count, payload bytes); async: the collectives "
                  f"scheduled as start/done pairs (what can overlap compute).", ""]
        rows = []
        for layout in ("replicated", "zero1", "fsdp"):
            x = runs.get(layout)
            if x:
                c = x["collectives"]
                rows.append([layout, f"{x['argument']:,}", f"{x['temp']:,}", f"{x['peak']:,}",
                             *[f"{c[k]['count']} / {c[k]['bytes']:,}" for k in ("all-reduce", "reduce-scatter",
                                                                               "all-gather")],
                             x["async_starts"], x["compile_s"]])
        lines += _table(["layout", "arguments B", "temporaries B", "XLA peak B", "all-reduce", "reduce-scatter",
                         "all-gather", "async", "compile s"], rows) + [""]
    return lines


def render(report: dict) -> str:
    """The whole report as markdown."""
    parts = report["parts"]
    lines = [f"# jdp GPU check ({report['mode']})", "",
             f"Created {report['created']}; {report.get('seconds', '?')} s so far. "
             + ("DRY RUN on a CPU: tiny sizes, the numbers say nothing about a GPU." if report["mode"] == "dry" else
                "One GPU, GPT-2 small (configs/gpt2_small.yaml)."), ""]
    lines += _env(parts.get("env")) + _tests(parts.get("tests")) + _throughput(parts.get("throughput"))
    lines += _fsdp(parts.get("fsdp")) + _largest(parts.get("largest_batch")) + _exactness(parts.get("exactness"))
    lines += _cpu_bf16(parts.get("cpu_bf16_comm"))
    raw = {k: {kk: vv for kk, vv in v.items() if kk != "output_tail"} for k, v in parts.items()}
    lines += ["## Raw results", "", "```json", json.dumps({"plan": report["plan"], "parts": raw}, indent=1,
                                                          default=str), "```", ""]
    return "\n".join(lines)
