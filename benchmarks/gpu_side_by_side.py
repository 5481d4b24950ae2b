"""GPT-2 small on one GPU, side by side: jdp's step, a hand-written `jax.jit` step, nanoGPT (PyTorch), and
jdp with the fused, chunked cross-entropy; one framework per process.

  python -m benchmarks.gpu_side_by_side [--dry-run] [--out DIR] [--rows a,b,...] [--loss-chunk N]
                                        [--xla-flags "FLAGS"] [--fused-update] [--steps S] [--repeats R]

Every row trains GPT-2 small as nanoGPT does (vocab 50304, context 1024, 12 layers × 768, 12 heads, no
bias, tied head, exact GELU, dropout 0; float32 master params, bfloat16 compute; AdamW after clipping at
1.0; batch 32 × 1024) on the same seeded random tokens in a fresh process (`benchmarks.side_by_side_rows`):
`warmup` steps, then `repeats` windows of `steps` steps; the median window's ms/step, tokens/s, and MFU by
nanoGPT's count, (6·N + 12·L·H·Q·T) FLOP per token with N every param but the position embedding, over the
device's peak bf16 FLOP/s (`jdp.run.metrics.peak_flops`: 989e12 for an H100/H200). A last process times an
8192³ bfloat16 matmul in jax, the rate the matmuls of the step could reach.

Rows: `jdp` (`make_train_step(..., precision="bfloat16")`, GPT attention "cudnn" on a GPU), `jit` (the
same model and optimizer in a hand-written `jax.jit` step, donated buffers), `nanogpt` (the vendored
benchmarks/nanogpt_peer/model.py, `torch.compile`, autocast bf16, its fused AdamW; torch from the `bench`
extra), `jdp_fused_xent` (the jdp row with `GPT.token_losses`, `--loss-chunk` positions per block). Options
to try on a GPU: `--xla-flags` adds the rows `jdp+flags` and `jdp_fused_xent+flags`, run with XLA_FLAGS set
to it; `--fused-update` adds `jdp_fused_update` (AdamW on one flat vector of every param).

`--dry-run`: tiny sizes and few steps, on whatever device there is (a CPU here): every row runs end to end;
the torch row runs eager where no CUDA device is, and says so. Writes DIR/report.json and DIR/report.md
(default benchmarks/results/gpu_side_by_side/). Exit 0 when every row ran, 1 otherwise.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

from benchmarks.common import ROOT, child_env

FULL = dict(vocab=50304, context=1024, d_model=768, n_heads=12, n_layers=12, batch=32, warmup=3, steps=10,
            repeats=3, distinct=4, matmul_n=8192, loss_chunk=128)
DRY = dict(vocab=512, context=64, d_model=64, n_heads=2, n_layers=2, batch=4, warmup=2, steps=2, repeats=2,
           distinct=2, matmul_n=512, loss_chunk=16)
ROWS = ("jdp", "jit", "nanogpt", "jdp_fused_xent")
LABELS = {
    "jdp": 'jdp: `make_train_step(..., precision="bfloat16")`, GPT attention {attention}',
    "jit": "the same model, a hand-written `jax.jit` step (donated buffers)",
    "nanogpt": "nanoGPT `model.py`, {how}",
    "jdp_fused_xent": "jdp, the fused chunked cross-entropy (`GPT.token_losses`, {loss_chunk} positions a block)",
    "jdp_fused_update": "jdp, AdamW on one flat vector of every param (`optax.flatten`)",
}
DEFAULT_OUT = os.path.join(ROOT, "benchmarks", "results", "gpu_side_by_side")


def flops_per_token(spec: dict) -> float:
    """nanoGPT's `estimate_mfu` count: 6·N + 12·L·H·Q·T, N = params without the position embedding
    (tied head, no bias: V·d + L·(12·d² + 2·d) + d)."""
    d, n_layers = spec["d_model"], spec["n_layers"]
    n = spec["vocab"] * d + n_layers * (12 * d * d + 2 * d) + d
    return 6 * n + 12 * n_layers * spec["n_heads"] * (d // spec["n_heads"]) * spec["context"]


def row_plan(args) -> list[tuple[str, str, dict, str | None]]:
    """(row id, row kind, spec overrides, XLA_FLAGS or None) for every row asked for."""
    plan = []
    for name in args.rows:
        plan.append((name, name, {"loss_chunk": args.loss_chunk} if name == "jdp_fused_xent" else {"loss_chunk": 0},
                     None))
    if args.fused_update:
        plan.append(("jdp_fused_update", "jdp", {"loss_chunk": 0, "fused_update": True}, None))
    if args.xla_flags:
        for name, overrides in (("jdp", {"loss_chunk": 0}), ("jdp_fused_xent", {"loss_chunk": args.loss_chunk})):
            plan.append((f"{name}+flags", name, overrides, args.xla_flags))
    return plan


def run_child(kind: str, spec: dict, xla_flags: str | None, timeout: float) -> dict:
    """One row in a fresh process: its RESULT line's JSON, or {"error": ...}."""
    env = child_env(PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if xla_flags:
        env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", ""), xla_flags]).strip()
    t0 = time.perf_counter()
    try:
        r = subprocess.run([sys.executable, "-m", "benchmarks.gpu_side_by_side", "--row", kind, "--spec",
                            json.dumps(spec)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"stopped at its time limit ({timeout:.0f} s)"}
    lines = [line for line in r.stdout.splitlines() if line.startswith("RESULT ")]
    if r.returncode or not lines:
        return {"error": (r.stderr.strip().splitlines() or ["no output"])[-1][:400]}
    return {**json.loads(lines[-1][len("RESULT "):]), "process_s": time.perf_counter() - t0}


def summarise(row: dict, spec: dict, peak: float | None) -> dict:
    """tokens/s and MFU of a timed row."""
    if "median_step_s" not in row:
        return row
    tokens = spec["batch"] * spec["context"] / row["median_step_s"]
    return {**row, "tokens_per_s": tokens, "mfu": tokens * flops_per_token(spec) / peak if peak else None}


def markdown(report: dict) -> str:
    """The report as a table, one row a line, every number as measured."""
    s = report["spec"]
    lines = [f"# GPT-2 side by side{' (dry run: tiny sizes)' if report['dry_run'] else ''}", "",
             f"{report['created']}; {report['device_kind']}; peak bf16 FLOP/s "
             f"{report['peak_flops'] or 'unknown (no MFU)'}; model vocab {s['vocab']}, context {s['context']}, "
             f"{s['n_layers']} layers × {s['d_model']}, {s['n_heads']} heads, batch {s['batch']}; "
             f"{s['warmup']} warm-up steps, median of {s['repeats']} windows of {s['steps']} steps; "
             f"{flops_per_token(s) / 1e6:.1f} MFLOP per token (6·N + 12·L·H·Q·T).", "",
             "| row | what | median ms/step | tokens/s | MFU | peak memory GB | last loss |", "|---|---|---|---|---|---|---|"]
    for name, row in report["rows"].items():
        what = LABELS[row.get("kind", name)].format(attention=row.get("attention"), how=row.get("how"),
                                                    loss_chunk=s["loss_chunk"])
        if row.get("xla_flags"):
            what += f"; XLA_FLAGS `{row['xla_flags']}`"
        if "error" in row:
            lines.append(f"| {name} | {what} | failed: {row['error']} | | | | |")
            continue
        mem = row.get("peak_memory_bytes")
        mfu = f"{row['mfu']:.1%}" if row.get("mfu") is not None else "n/a"
        lines.append(f"| {name} | {what} | {row['median_step_s'] * 1e3:.1f} | {row['tokens_per_s']:,.0f} | {mfu} | "
                     f"{mem / 1e9:.1f} | {row['last_loss']:.4f} |" if mem else
                     f"| {name} | {what} | {row['median_step_s'] * 1e3:.1f} | {row['tokens_per_s']:,.0f} | {mfu} | "
                     f"n/a | {row['last_loss']:.4f} |")
    m = report["matmul"]
    lines += ["", f"{m['n']}³ bfloat16 matmul in jax: {m['flops_per_s'] / 1e12:.4g} TFLOP/s." if "n" in m
              else f"matmul: failed: {m['error']}"]
    return "\n".join(lines) + "\n"


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_side_by_side", description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="tiny sizes, few steps: every row end to end on a CPU")
    p.add_argument("--out", default=DEFAULT_OUT, help="folder for report.json and report.md")
    p.add_argument("--rows", default=",".join(ROWS), help=f"a comma-separated subset of {','.join(ROWS)}")
    p.add_argument("--loss-chunk", type=int, default=None, help="positions per block of the fused cross-entropy")
    p.add_argument("--xla-flags", default="", help="also run the jdp rows with XLA_FLAGS set to this")
    p.add_argument("--fused-update", action="store_true", help="also run jdp with AdamW on one flat vector")
    p.add_argument("--steps", type=int, default=None, help="timed steps per window")
    p.add_argument("--repeats", type=int, default=None, help="timed windows")
    p.add_argument("--row", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.rows = [r for r in args.rows.split(",") if r]
    bad = [r for r in args.rows if r not in ROWS]
    if bad:
        p.error(f"--rows {','.join(bad)}: not a row; the rows are {','.join(ROWS)}")
    for name in ("loss_chunk", "steps", "repeats"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be a positive integer")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if args.row:  # a child: one row, its result on stdout
        from benchmarks.side_by_side_rows import run_row

        print("RESULT " + json.dumps(run_row(args.row, json.loads(args.spec))), flush=True)
        return 0
    spec = dict(DRY if args.dry_run else FULL)
    spec.update({k: v for k, v in (("steps", args.steps), ("repeats", args.repeats), ("loss_chunk", args.loss_chunk))
                 if v is not None})
    timeout = 300 if args.dry_run else 600
    rows = {}
    for name, kind, overrides, flags in row_plan(args):
        row = run_child(kind, {**spec, **overrides}, flags, timeout)
        rows[name] = {**row, "kind": "jdp_fused_update" if overrides.get("fused_update") else kind,
                      **({"xla_flags": flags} if flags else {})}
        print(f"{name}: " + (row["error"] if "error" in row else f"{row['median_step_s'] * 1e3:.1f} ms/step"), flush=True)
    matmul = run_child("matmul", spec, None, timeout)
    from jdp.run.metrics import peak_flops

    kind = next((r["device_kind"] for r in rows.values() if "device_kind" in r), matmul.get("device_kind", "unknown"))
    peak = peak_flops(kind)
    report = {"created": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
              "dry_run": args.dry_run, "spec": spec, "device_kind": kind, "peak_flops": peak,
              "flops_per_token": flops_per_token(spec),
              "rows": {name: {**summarise(r, spec, peak)} for name, r in rows.items()}, "matmul": matmul}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(args.out, "report.md"), "w") as f:
        f.write(markdown(report))
    print(markdown(report))
    return 0 if all("error" not in r for r in (*rows.values(), matmul)) else 1


if __name__ == "__main__":
    sys.exit(main())
