"""benchmarks/gpu_check.sh's report: one markdown document that stands alone (when, on what, with which
versions, by which command), a summary with one number or one reason per part, each part's section
(the sections of the parts in benchmarks.gpu_parts are benchmarks.gpu_report's), and the raw results.
"""
from __future__ import annotations

import json

from benchmarks import gpu_report as g

ORDER = ("env", "tests", "throughput", "fit", "exactness", "cpu_bf16_comm", "layouts", "decode", "side_by_side")
TITLES = {"env": "machine", "tests": "(a) tests on the device", "throughput": "(b) float32 vs bfloat16",
          "fit": "(c) largest batch, from compiled memory", "exactness": "(d) bf16 exactness on the device",
          "cpu_bf16_comm": "(d iii) bf16 communication, fake CPU devices",
          "layouts": "(e) layouts compiled for 8 fake CPU devices", "decode": "(f) decoding (benchmarks.sample)",
          "side_by_side": "(g) side by side (benchmarks.gpu_side_by_side)"}


def _first(rows: list[dict], *keys: str) -> str | None:
    for row in rows:
        for k in keys:
            for head, cell in row.items():
                if k in head.lower() and any(ch.isdigit() for ch in cell):
                    return f"{head}: {cell}"
    return None


def headline(name: str, part: dict | None) -> str | None:
    """The part's main number in a few words, or None where it has none."""
    r = (part or {}).get("result") or {}
    try:
        if name == "env":
            return (f"{r['device_kind']}, {len(r['devices'])} device(s), memory limit "
                    f"{g._num(r['memory_limit_bytes'], '{:,}')} B")
        if name == "tests":
            tot = {k: sum(f.get(k, 0) for f in r["files"]) for k in ("passed", "failed", "error", "not run")}
            files_not_run = sum(f["status"].startswith("not run") for f in r["files"])
            return (f"{tot['passed']} passed, {tot['failed']} failed, {tot['error']} errors, {tot['not run']} not run"
                    f" (+ {files_not_run} selection(s) not started)")
        if name == "throughput":
            return ", ".join(f"{k}: {v['tokens_per_s']:,.0f} tokens/s" for k, v in r.items())
        if name == "fit":
            said = []
            for key, s in r.items():
                timed = s.get("timed")
                said.append(f"{key}: batch {s['global_batch']}" + (f", {timed['tokens_per_s']:,.0f} tokens/s" if timed
                                                                    else ""))
            return "; ".join(said) or None
        if name == "exactness":
            return f"sgd bf16 compute vs float32: {r['runs']['sgd: bfloat16 compute']['vs_float32_here']:.1e}"
        if name == "cpu_bf16_comm":
            return f"bf16 all-reduce, worst max Δparam / moved: {g._share(max(x['relative'] for x in r['rows']))}"
        if name == "layouts":
            runs = next(iter(r["runs"].values()))
            return ", ".join(f"{k} peak {v['peak']:,} B" for k, v in runs.items() if "peak" in v) or None
        if name in ("decode", "side_by_side"):
            return _first(r["rows"], "tokens/s", "ms", "mfu")
    except (KeyError, TypeError, StopIteration, ValueError, IndexError):
        return None
    return None


def summary(parts: dict) -> list[str]:
    """One row per part: how it ended, its seconds, and its number, or the one line saying why none."""
    rows = []
    for name in ORDER:
        part = parts.get(name)
        status = (part or {}).get("status", "not reached")
        number = headline(name, part) or (f"none: {status}" if status != "ok" else "none: it measured nothing")
        rows.append([TITLES[name], status, g._num((part or {}).get("seconds")), number])
    return ["## Summary", ""] + g._table(["part", "status", "s", "number"], rows) + [""]


def _tests(part: dict | None) -> list[str]:
    r = (part or {}).get("result") or {}
    lines = ["## (a) Tests that need one device, on the device", ""] + g._status(part)
    if r:
        lines += [f"JDP_TEST_PLATFORM={r['platform']}, JAX_DEFAULT_MATMUL_PRECISION={r['matmul_precision']} "
                  "(the tests' float32 tolerances assume IEEE float32 matmuls, not TF32); each selection in its "
                  "own `pytest -v` under its time limit; `not run`: selected, but the limit came first.", ""]
        kinds = ("passed", "failed", "error", "skipped", "not run")
        rows = [[f"`{f['file']}`" + (f" -k `{f['select']}`" if f["select"] else ""), *[f.get(k, 0) for k in kinds],
                 f["budget_s"], g._num(f.get("seconds")), f["status"]] for f in r["files"]]
        total = [sum(f.get(k, 0) for f in r["files"]) for k in kinds]
        lines += g._table(["selection", *kinds, "limit s", "s", "status"], rows + [["**total**", *total, "", "", ""]])
        lines += [""] + [f"- {line}" for f in r["files"] for line in f.get("failures", [])] + [""]
    return lines


def _fit(part: dict | None) -> list[str]:
    r = (part or {}).get("result") or {}
    lines = ["## (c) Largest global batch that fits, bfloat16, from the compiled step's memory", ""] + g._status(part)
    for key, s in r.items():
        probes = ", ".join(f"{p['batch']}: {p['bytes'] / 2**30:.2f} GiB ({p['compile_s']} s)" for p in s["probes"])
        lines += [f"- **{key}**: compiled (not run) at {probes or 'none'}; limit {s.get('limit', '?')}"
                  f" = {g._num(s.get('limit_bytes') and s['limit_bytes'] / 2**30, '{:.2f}')} GiB; "
                  f"largest that fits: **{s.get('global_batch')}** windows of {s['context']} tokens"]
        t = s.get("timed")
        if t:
            lines += [f"  - timed at that batch ({t['steps']} steps after the first call): "
                      f"{t['median_step_s'] * 1e3:,.1f} ms/step, {t['tokens_per_s']:,.0f} tokens/s, MFU "
                      f"{g._num(t['mfu'], '{:.1%}')}, first call {t['first_call_s']:.1f} s, process peak "
                      f"{g._num(t['peak_memory_bytes'] and t['peak_memory_bytes'] / 2**30, '{:.1f}')} GiB"]
    return lines + [""]


def _layouts(part: dict | None) -> list[str]:
    r = (part or {}).get("result") or {}
    lines = ["## (e) Replicated / ZeRO-1 / FSDP / jit compiled for fake CPU devices (compiled, not run)", ""]
    lines += g._status(part)
    for n, runs in r.get("runs", {}).items():
        m = next((v for k, v in runs.items() if k == "model"), None)
        if m:
            lines += [f"N = {n} CPU devices in a CPU process (JAX_PLATFORMS=cpu; one GPU has no peers): GPT "
                      f"{m['params']:,} params, {m['n_layers']} layers, d_model {m['d_model']}, {m['per_device']} "
                      f"windows of {m['context']} tokens per device, bf16 compute, AdamW, remat {m['remat']}. Bytes "
                      "per device from XLA's memory analysis; the compiled program's collectives (count / bytes).", ""]
        rows = []
        for layout, x in runs.items():
            if layout == "model":
                continue
            if "error" in x:
                rows.append([layout, x["error"], "", "", "", "", "", ""])
                continue
            c = x["collectives"]
            rows.append([layout, f"{x['argument']:,}", f"{x['temp']:,}", f"{x['peak']:,}",
                         *[f"{c[k]['count']} / {c[k]['bytes']:,}"
                           for k in ("all-reduce", "reduce-scatter", "all-gather")],
                         x["compile_s"]])
        lines += g._table(["layout", "arguments B", "temporaries B", "XLA peak B", "all-reduce", "reduce-scatter",
                           "all-gather", "compile s"], rows) + [""]
    return lines


def _command(title: str, part: dict | None) -> list[str]:
    """A part that ran a command: the command, how it ended, and what it printed or wrote."""
    r = (part or {}).get("result") or {}
    lines = [f"## {title}", ""] + g._status(part)
    if r:
        lines += [f"`{r['command']}`", ""]
        if r.get("first_line"):
            lines += [r["first_line"], ""]
        for name, text in r.get("markdown", {}).items():  # its own report, headings moved two levels down
            moved = [("##" + x if x.startswith("#") else x) for x in text.strip().splitlines()]
            lines += [f"`{name}`:", ""] + moved + [""]
        if r.get("rows") and not r.get("markdown"):
            head = list(r["rows"][0])
            lines += g._table(head, [[row.get(h, "") for h in head] for row in r["rows"]]) + [""]
    return lines


def render(report: dict) -> str:
    """The whole report as markdown."""
    parts, env = report["parts"], ((report["parts"].get("env") or {}).get("result") or {})
    dry = report["mode"] == "dry"
    versions = env.get("versions", {})
    lines = [f"# jdp GPU check ({report['mode']})", "",
             ("DRY RUN on a CPU: tiny sizes, the numbers say nothing about a GPU. " if dry else "")
             + f"Created {report['created']} by `{report['command']}`; {report.get('seconds', '?')} s so far. "
             f"Device: {env.get('device_kind', 'unknown')}; jax {versions.get('jax', '?')}, jaxlib "
             f"{versions.get('jaxlib', '?')}, flax {versions.get('flax', '?')}, optax {versions.get('optax', '?')}, "
             f"Python {env.get('python', '?')}. Model: GPT {report['plan']['gpt']}"
             + ("" if dry else " (configs/gpt2_small.yaml's GPT-2 small on a 103-symbol vocabulary)") + ".", "",
             f"Install: {report['install']}", ""]
    lines += summary(parts) + g._env(parts.get("env")) + _tests(parts.get("tests"))
    lines += g._throughput(parts.get("throughput")) + _fit(parts.get("fit")) + g._exactness(parts.get("exactness"))
    lines += g._cpu_bf16(parts.get("cpu_bf16_comm")) + _layouts(parts.get("layouts"))
    lines += _command("(f) Decoding speed (benchmarks.sample)", parts.get("decode"))
    lines += _command("(g) Side by side with a hand-written jit step and nanoGPT (benchmarks.gpu_side_by_side)",
                      parts.get("side_by_side"))
    raw = {k: {kk: vv for kk, vv in v.items() if kk != "output_tail"} for k, v in parts.items()}
    lines += ["## Raw results", "", "```json", json.dumps({"plan": report["plan"], "parts": raw}, indent=1,
                                                          default=str), "```", ""]
    return "\n".join(lines)
