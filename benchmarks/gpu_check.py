"""benchmarks/gpu_check.sh: what one GPU (an H200) can tell about jdp in at most 8 minutes, in ONE
markdown report (default $OUT/gpu_check.md where OUT is set, else benchmarks/results/gpu_check.md).

  (a) tests      the suite's files that never ask for more than one device, on the GPU
                 (JDP_TEST_PLATFORM=cuda), each file in its own pytest with a time limit
  (b) throughput GPT-2 small (configs/gpt2_small.yaml's model) float32 vs bfloat16 through
                 jdp's step `precision=`: step time, tokens/s, MFU
  (c) largest    the largest global batch that fits, bfloat16, remat on and off
  (d) exactness  (i) bf16 compute vs float32 on the GPU, (ii) a 1-device step with
                 reduce_dtype=bf16 (no all-reduce at N=1) and what its compiled HLO keeps, and
                 (iii) `jdp explain`'s bf16 gradient communication on 8 fake CPU devices (CPU!)
  (e) fsdp       replicated / ZeRO-1 / FSDP (shard_params) compiled by XLA's GPU compiler for 8
                 mocked GPUs (jax_mock_gpu_topology: compiled, never run): bytes per device, XLA's
                 peak under the GPU scheduler, the collectives and how many are asynchronous

Each part runs in its own process (benchmarks/gpu_parts.py) under a time limit of min(its budget,
time left before the deadline), so a failing or slow part leaves its error and partial results
and the others still run; the report is rewritten after every part. (d iii) runs on the CPU in
the background from the start. `--dry-run` (or JDP_GPU_CHECK_DRY_RUN=1) runs the same code on
this CPU with a tiny GPT, a few steps and two test files, and writes gpu_check_dry_run.md.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

from benchmarks.common import child_env
from benchmarks.gpu_parts import ROOT, plan_named
from benchmarks.gpu_report import render

# Test files and -k selections that never ask for more than one device and assume no CPU: they
# build steps and models on the default devices (all of them: one GPU), or none at all. Left out:
# every test that takes jax.devices()[:n] with n > 1 (on one device it would pass without testing
# n), reads fake CPU devices (jdp explain's), starts a subprocess with --devices N, or expects a
# CPU-only refusal (attention="cudnn"). Each selection passes with JDP_TEST_PLATFORM=cpu (one CPU
# device). The first two are quick: the dry run takes those.
TESTS = (
    ("tests/test_precision.py", "test_bad_dtypes_are_refused or test_bf16_master_params_are_refused"),
    ("tests/test_data_order.py", ""),
    ("tests/test_model_precision.py", "not test_bad_attention and not test_options_train_through"),
    ("tests/test_models.py", "not sync_batchnorm and not masks_differ_per_device and not 1_and_4_devices "
                             "and not linen_example"),
    ("tests/test_nnx.py", "test_bad_input_is_one_sentence"),
    ("tests/test_config.py", "not reproduces_the_seed_step and not runs_as_the_mean"),
    ("tests/test_data.py", ""),
)
GPU_PARTS = ("env", "exactness", "throughput", "tests", "fsdp", "largest_batch")


def part_env(platform: str | None, **extra) -> dict:
    """This process's environment for a part: no fake CPU device count, JAX_PLATFORMS `platform`
    (None: jax chooses, i.e. the GPU), jdp and benchmarks importable from the checkout."""
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
    return child_env("JAX_PLATFORMS", PYTHONUNBUFFERED="1", PYTHONPATH=path,
                     **({"JAX_PLATFORMS": platform} if platform else {}), **extra)


def start_part(name: str, plan, workdir: str, platform: str | None, **extra):
    """Start part `name` in a child process; its results go to workdir/NAME.json as it measures."""
    path = os.path.join(workdir, f"{name}.json")
    log = open(os.path.join(workdir, f"{name}.log"), "w+", encoding="utf-8")
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.gpu_parts", name, plan.name, path], cwd=ROOT,
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


_COUNTS = re.compile(r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed|xpassed)")


def pytest_counts(output: str) -> dict:
    """{"passed": 3, "failed": 1, ...} from pytest's last summary line ("3 passed, 1 failed in 2.1s")."""
    lines = [line for line in output.splitlines() if re.search(r"\bin [\d.]+s\b", line) and _COUNTS.search(line)]
    counts = {kind.rstrip("s") if kind.startswith("error") else kind: int(n)
              for n, kind in _COUNTS.findall(lines[-1] if lines else "")}
    return counts


def run_tests(plan, deadline: float) -> dict:
    """(a) Each selected test file in its own pytest on the plan's platform, with a time limit."""
    env = part_env(None, JDP_TEST_PLATFORM=plan.test_platform, XLA_PYTHON_CLIENT_PREALLOCATE="false",
                    JAX_DEFAULT_MATMUL_PRECISION="highest")  # the tests' float32 tolerances assume IEEE f32 matmuls
    rows = []
    for path, select in TESTS[:plan.test_files]:
        left = deadline - time.perf_counter()
        if left < 5:
            rows.append({"file": path, "select": select, "status": "not run: the part's time was spent"})
            continue
        timeout = min(plan.test_timeout_s, left)
        # -o addopts=: one process, and no need for pytest-xdist (the repo's addopts ask for workers)
        cmd = [sys.executable, "-m", "pytest", path, "-o", "addopts=", "-q", "-p", "no:cacheprovider", "-rfE",
               "--tb=line"]
        t0 = time.perf_counter()
        try:
            r = subprocess.run(cmd + (["-k", select] if select else []), cwd=ROOT, env=env, capture_output=True,
                               text=True, timeout=timeout)
            out, status = r.stdout + r.stderr, "ok" if r.returncode == 0 else f"exit {r.returncode}"
        except subprocess.TimeoutExpired as e:  # its captured output is bytes, whatever text= says
            out, status = (e.stdout or b"").decode(errors="replace"), f"stopped at its time limit ({timeout:.0f} s)"
        failures = [line for line in out.splitlines() if line.startswith(("FAILED", "ERROR"))][:10]
        rows.append({"file": path, "select": select, "status": status, "seconds": round(time.perf_counter() - t0, 1),
                     **pytest_counts(out), "failures": failures})
    return {"platform": plan.test_platform, "matmul_precision": "highest", "files": rows}


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", default=os.environ.get("JDP_GPU_CHECK_DRY_RUN") == "1",
                    help="rehearse on this CPU: tiny GPT, few steps, two test files (also JDP_GPU_CHECK_DRY_RUN=1)")
    ap.add_argument("--out", help="the report file (default $OUT/gpu_check.md, else benchmarks/results/gpu_check.md)")
    args = ap.parse_args(argv)
    plan = plan_named("dry" if args.dry_run else "full")
    out = args.out or default_out(args.dry_run)
    t0 = time.perf_counter()
    deadline = t0 + plan.deadline_s
    gpu = "cpu" if args.dry_run else None  # the full check leaves the platform to jax: the GPU
    report = {"mode": plan.name, "created": time.strftime("%Y-%m-%d %H:%M:%S %z"), "plan": plan.__dict__, "parts": {}}
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as work:
        background = start_part("cpu_bf16_comm", plan, work, "cpu")  # (d iii): CPU only, beside the GPU parts
        for name in GPU_PARTS:
            left = deadline - time.perf_counter()
            budget = min(plan.budgets[name], left)
            print(f"gpu_check: {name} (up to {budget:.0f} s)", file=sys.stderr, flush=True)
            if budget < 5:
                report["parts"][name] = {"status": "not run: the check's time was spent"}
            elif name == "tests":
                t = time.perf_counter()
                report["parts"][name] = {"status": "ok", "result": run_tests(plan, t + budget),
                                         "seconds": round(time.perf_counter() - t, 1)}
            else:
                extra = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.95"} if name == "largest_batch" else {}
                report["parts"][name] = finish_part(start_part(name, plan, work, gpu, **extra), budget)
            report["seconds"] = round(time.perf_counter() - t0, 1)
            write_report(report, out)
        left = min(plan.budgets["cpu_bf16_comm"] - (time.perf_counter() - background["t0"]),
                   deadline - time.perf_counter())
        report["parts"]["cpu_bf16_comm"] = finish_part(background, left)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    write_report(report, out)
    print(f"gpu_check: report written to {out} ({report['seconds']} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
