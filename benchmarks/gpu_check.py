"""benchmarks/gpu_check.sh: what one GPU (an H200) can tell about jdp in at most 8 minutes, in ONE
markdown report (default $OUT/gpu_check.md where OUT is set, else benchmarks/results/gpu_check.md).

On the GPU, one after another, each under min(its budget, time left before the deadline):
  env         Python, jax/flax/optax versions, the device, its peak FLOP/s and memory limit
  exactness   (d) bf16 compute vs float32 on the device; a 1-device reduce_dtype=bf16 step's HLO
  tests       (a) test selections that need one device, quickest first, each under its own limit
              (benchmarks.gpu_check_cmds.TESTS); per test: passed / failed / skipped / not run
  throughput  (b) GPT-2 small float32 vs bfloat16 (and bf16 with cuDNN attention): tokens/s, MFU
  fit         (c) the largest batch from XLA's memory analysis of the compiled step (nothing runs
              while it searches), then one timed run at it (benchmarks.gpu_check_parts)
  decode      (f) `python -m benchmarks.sample`
  side_by_side (g) `python -m benchmarks.gpu_side_by_side --out DIR`, where the module exists
On the CPU, beside them from the start (fake CPU devices, JAX_PLATFORMS=cpu):
  cpu_bf16_comm (d iii) `jdp explain`'s bf16 gradient communication
  layouts     (e) replicated / ZeRO-1 / FSDP / jit compiled for 8 fake CPU devices (no GPU topology
              is mocked: one cannot sit beside a real GPU)

Each part runs in its own process, so a failing or slow part leaves its error and partial results
and the others still run; the report (benchmarks.gpu_check_report) is rewritten after every part.
`--dry-run` (or JDP_GPU_CHECK_DRY_RUN=1) runs every part on this CPU with a tiny GPT, the first
test selection and a few steps, and writes gpu_check_dry_run.md.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from benchmarks.common import child_env
from benchmarks.gpu_check_cmds import run_decode, run_side_by_side, run_tests
from benchmarks.gpu_check_report import render
from benchmarks.gpu_parts import ROOT, plan_named

GPU_PARTS = ("env", "exactness", "tests", "throughput", "fit", "decode", "side_by_side")  # one after another
CPU_PARTS = {"cpu_bf16_comm": "benchmarks.gpu_parts", "layouts": "benchmarks.gpu_check_parts"}  # beside them
MODULES = {"env": "benchmarks.gpu_parts", "exactness": "benchmarks.gpu_parts", "throughput": "benchmarks.gpu_parts",
           "fit": "benchmarks.gpu_check_parts", **CPU_PARTS}


def part_env(platform: str | None, **extra) -> dict:
    """This process's environment for a part: no fake CPU device count, JAX_PLATFORMS `platform`
    (None: jax chooses, i.e. the GPU), jdp and benchmarks importable from the checkout."""
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
    return child_env("JAX_PLATFORMS", PYTHONUNBUFFERED="1", PYTHONPATH=path,
                     **({"JAX_PLATFORMS": platform} if platform else {}), **extra)


def start_part(name: str, plan, workdir: str, platform: str | None, seconds: float, **extra):
    """Start part `name` in a child process (MODULES[name]); its results go to workdir/NAME.json as it
    measures. A part of benchmarks.gpu_check_parts is told its `seconds` (it plans its compiles)."""
    path = os.path.join(workdir, f"{name}.json")
    log = open(os.path.join(workdir, f"{name}.log"), "w+", encoding="utf-8")
    tell = [f"{seconds:.0f}"] if MODULES[name] == "benchmarks.gpu_check_parts" else []
    proc = subprocess.Popen([sys.executable, "-m", MODULES[name], name, plan.name, path, *tell], cwd=ROOT,
                            env=part_env(platform, **extra), stdout=log, stderr=subprocess.STDOUT)
    return {"name": name, "proc": proc, "path": path, "log": log, "t0": time.perf_counter()}


def finish_part(started: dict, timeout: float) -> dict:
    """Wait up to `timeout` s for a started part; its status, seconds, results (partial if it
    stopped early) and, unless it succeeded, the end of its output."""
    proc = started["proc"]
    try:
        rc = proc.wait(timeout=max(timeout, 0.1))
        status = "ok" if rc == 0 else f"failed (exit {rc})"
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        status = f"stopped at its time limit ({timeout:.0f} s)"
    started["log"].seek(0)
    tail = started["log"].read()[-3000:]
    started["log"].close()
    result = None
    if os.path.exists(started["path"]):
        with open(started["path"], encoding="utf-8") as f:
            result = json.load(f)
    return {"status": status, "seconds": round(time.perf_counter() - started["t0"], 1), "result": result,
            **({} if status == "ok" else {"output_tail": tail})}


def default_out(dry: bool) -> str:
    name = "gpu_check_dry_run.md" if dry else "gpu_check.md"  # a rehearsal never overwrites a GPU report
    return os.path.join(os.environ["OUT"], name) if os.environ.get("OUT") else os.path.join(ROOT, "benchmarks",
                                                                                           "results", name)


def write_report(report: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(render(report))
    os.replace(tmp, path)


def run_gpu_part(name: str, plan, work: str, budget: float) -> dict:
    """One of GPU_PARTS under `budget` seconds, on the GPU (the CPU in a rehearsal)."""
    platform = "cpu" if plan.name == "dry" else None  # the full check leaves the platform to jax: the GPU
    env = part_env(platform, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    t = time.perf_counter()
    if name == "tests":  # the tests' float32 tolerances assume IEEE f32 matmuls, not TF32
        env = part_env(None, JDP_TEST_PLATFORM=plan.test_platform, XLA_PYTHON_CLIENT_PREALLOCATE="false",
                       JAX_DEFAULT_MATMUL_PRECISION="highest")
        result = run_tests(plan, env, t + budget)
        return {"status": "ok", "result": result, "seconds": round(time.perf_counter() - t, 1)}
    if name == "decode":
        return run_decode(plan, env, budget)
    if name == "side_by_side":
        return run_side_by_side(plan, env, budget, os.path.join(work, "side_by_side"))
    extra = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.95"} if name == "fit" else {}  # the search's limit
    return finish_part(start_part(name, plan, work, platform, budget, **extra), budget)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", default=os.environ.get("JDP_GPU_CHECK_DRY_RUN") == "1",
                    help="rehearse on this CPU: tiny GPT, few steps, every part (also JDP_GPU_CHECK_DRY_RUN=1)")
    ap.add_argument("--out", help="the report file (default $OUT/gpu_check.md, else benchmarks/results/gpu_check.md)")
    args = ap.parse_args(argv)
    plan = plan_named("dry" if args.dry_run else "full")
    out = args.out or default_out(args.dry_run)
    t0 = time.perf_counter()
    deadline = t0 + plan.deadline_s
    report = {"mode": plan.name, "created": time.strftime("%Y-%m-%d %H:%M:%S %z"), "plan": plan.__dict__, "parts": {},
              "command": "benchmarks/gpu_check.sh" + (" --dry-run" if args.dry_run else ""),
              "install": os.environ.get("JDP_GPU_CHECK_INSTALL", "not run through benchmarks/gpu_check.sh")}
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as work:
        background = {name: start_part(name, plan, work, "cpu", min(plan.budgets[name], plan.deadline_s))
                      for name in CPU_PARTS}  # fake CPU devices, beside the GPU parts from the start
        for name in GPU_PARTS:
            budget = min(plan.budgets[name], deadline - time.perf_counter())
            print(f"gpu_check: {name} (up to {budget:.0f} s)", file=sys.stderr, flush=True)
            report["parts"][name] = ({"status": f"not run: the check's {plan.deadline_s} s were spent"}
                                     if budget < 5 else run_gpu_part(name, plan, work, budget))
            report["seconds"] = round(time.perf_counter() - t0, 1)
            write_report(report, out)
        for name, started in background.items():
            left = min(plan.budgets[name] - (time.perf_counter() - started["t0"]), deadline - time.perf_counter())
            report["parts"][name] = finish_part(started, left)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    write_report(report, out)
    print(f"gpu_check: report written to {out} ({report['seconds']} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
