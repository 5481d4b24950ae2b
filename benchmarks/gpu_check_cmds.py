"""The parts of benchmarks/gpu_check.sh that are commands of their own, run under a time limit and
read back from their output: (a) the tests that need one device, the decode benchmark
(`python -m benchmarks.sample`) and the side-by-side peer comparison
(`python -m benchmarks.gpu_side_by_side --out DIR`).

A command stopped at its time limit still leaves what it printed: the tests report each test that
finished (pytest -v) and the rest as not run, with the reason.
"""
from __future__ import annotations

import glob
import importlib.util
import os
import re
import subprocess
import sys
import time

from benchmarks.gpu_parts import ROOT

# (file, -k selection, seconds on the GPU, in the dry run): quickest first. Chosen for what one GPU can
# show that the CPU suite cannot: bf16 arithmetic and its program, the GPT's forward/backward and its
# attention kernels, decoding with the key/value cache. Every selection asks for one device only (a test
# that takes jax.devices()[:n] with n > 1 would pass without testing n). The seconds are a GPU's compile
# times: ~4x the CPU cost measured with JDP_TEST_PLATFORM=cpu and no fast-compile flags (the GPU compiler
# has none), plus pytest's and jax's start (~10 s); the CPU costs are in docs/performance.md.
TESTS = (
    ("tests/test_precision.py", "test_bad_dtypes_are_refused or test_bf16_master_params_are_refused or "
                                "test_bf16_mean_divides_before_it_sums or test_bf16_compute_is_in_the_program",
     25, True),
    ("tests/test_data_order.py", "", 15, False),
    ("tests/test_model_precision.py", "test_remat_is_in_the_jaxpr or test_bad_dtype_is_a_one_sentence or "
                                      "test_bf16_compute_with_float32_params_logits_and_gradients and mlp", 40, False),
    ("tests/test_models.py", "test_gpt_param_count or test_gpt_is_causal or test_gpt_scanned_is_the_same_model", 45,
     False),
    ("tests/test_precision.py", "test_model_state_and_mask_stay_float32 or test_bf16_reduce_dtype_costs", 40, False),
)
_OUTCOME = re.compile(r"^\S+::.*? (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)(?: |$)")  # pytest -v: "ID OUTCOME [ 5%]"
_SELECTED = re.compile(r"collected (\d+) items?(?: / (\d+) deselected)?")


def pytest_outcomes(output: str) -> dict:
    """{"passed": 3, "failed": 1, ..., "not run": 2} from `pytest -v` output, whole or cut off: each
    finished test's line, and the selected tests that have none as "not run"."""
    counts: dict = {}
    for line in output.splitlines():
        m = _OUTCOME.match(line)
        if m:
            kind = {"PASSED": "passed", "FAILED": "failed", "ERROR": "error", "SKIPPED": "skipped",
                    "XFAIL": "xfailed", "XPASS": "xpassed"}[m.group(1)]
            counts[kind] = counts.get(kind, 0) + 1
    m = _SELECTED.search(output)
    if m:
        selected = int(m.group(1)) - int(m.group(2) or 0)
        counts["not run"] = max(0, selected - sum(counts.values()))
    return counts


def run_command(cmd: list[str], env: dict, timeout: float) -> tuple[str, str, float]:
    """(output, status, seconds) of `cmd` from the checkout; status "ok", "exit N", or "stopped at its
    time limit (T s)" with what it printed up to then."""
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=max(timeout, 1))
        out, status = r.stdout + r.stderr, "ok" if r.returncode == 0 else f"exit {r.returncode}"
    except subprocess.TimeoutExpired as e:  # its captured output is bytes, whatever text= says
        out = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
        status = f"stopped at its time limit ({timeout:.0f} s)"
    return out, status, round(time.perf_counter() - t0, 1)


def run_tests(plan, env: dict, deadline: float) -> dict:
    """(a) Each TESTS entry in its own pytest (-v, one process) under min(its seconds, time left)."""
    rows = []
    for path, select, seconds, in_dry in TESTS:
        row = {"file": path, "select": select, "budget_s": seconds}
        left = deadline - time.perf_counter()
        if plan.name == "dry" and not in_dry:
            rows.append({**row, "status": "not run: the rehearsal runs the first selection only"})
            continue
        if left < min(seconds, 10):
            rows.append({**row, "status": f"not run: {left:.0f} s of the part's time left, it needs {seconds} s"})
            continue
        # -o addopts=: one process, no pytest-xdist (the repo's addopts ask for workers); -v: a line per test
        cmd = [sys.executable, "-m", "pytest", path, "-o", "addopts=", "-v", "-p", "no:cacheprovider", "-rfE",
               "--tb=line"] + (["-k", select] if select else [])
        out, status, took = run_command(cmd, env, seconds if plan.name != "dry" else left)
        failures = [line for line in out.splitlines() if line.startswith(("FAILED", "ERROR"))][:10]
        rows.append({**row, "status": status, "seconds": took, **pytest_outcomes(out), "failures": failures})
    return {"platform": plan.test_platform, "matmul_precision": "highest", "files": rows}


def module_missing(name: str) -> str | None:
    """One line if `python -m name` cannot run from this checkout, else None."""
    if importlib.util.find_spec(name) is None:
        return f"not run: {name} is not in this checkout"
    return None


def sample_command(dry: bool) -> list[str]:
    """`python -m benchmarks.sample`, with --dry-run where this version has it and a rehearsal asks."""
    help_text = subprocess.run([sys.executable, "-m", "benchmarks.sample", "--help"], cwd=ROOT,
                               capture_output=True, text=True, timeout=120).stdout
    flags = ["--dry-run"] if dry and "--dry-run" in help_text else (["--repeats", "1"] if dry else [])
    return [sys.executable, "-m", "benchmarks.sample", *flags]


def markdown_rows(text: str) -> list[dict]:
    """The rows of the markdown tables in `text` as {header: cell}."""
    rows, head = [], None
    for line in text.splitlines():
        if not line.startswith("|"):
            head = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if head is None:
            head = cells
        elif not all(set(c) <= set("-: ") for c in cells):
            rows.append(dict(zip(head, cells)))
    return rows


def run_decode(plan, env: dict, timeout: float) -> dict:
    """The decode benchmark's command, status, seconds and table rows (tokens/s with and without the cache)."""
    missing = module_missing("benchmarks.sample")
    if missing:
        return {"status": missing}
    cmd = sample_command(plan.name == "dry")
    out, status, took = run_command(cmd, env, timeout)
    rows = markdown_rows(out)
    result = {"command": "python -m " + " ".join(cmd[2:]), "rows": rows, "first_line": out.strip().split("\n")[0][:200]}
    tail = {} if status == "ok" and rows else {"output_tail": out[-3000:]}
    return {"status": status, "seconds": took, "result": result, **tail}


def run_side_by_side(plan, env: dict, timeout: float, out_dir: str) -> dict:
    """`python -m benchmarks.gpu_side_by_side [--dry-run] --out DIR`: status, seconds, and the markdown it
    wrote (its tables, kept whole for the report)."""
    missing = module_missing("benchmarks.gpu_side_by_side")
    if missing:
        return {"status": missing}
    cmd = [sys.executable, "-m", "benchmarks.gpu_side_by_side", *(["--dry-run"] if plan.name == "dry" else []),
           "--out", out_dir]
    out, status, took = run_command(cmd, env, timeout)
    written = sorted(glob.glob(os.path.join(out_dir, "**", "*"), recursive=True))
    markdown = {os.path.relpath(p, out_dir): open(p, encoding="utf-8").read() for p in written if p.endswith(".md")}
    result = {"command": "python -m " + " ".join(cmd[2:-1] + ["DIR"]),
              "files": [os.path.relpath(p, out_dir) for p in written if os.path.isfile(p)], "markdown": markdown,
              "rows": [r for text in markdown.values() for r in markdown_rows(text)]}
    tail = {} if status == "ok" and result["rows"] else {"output_tail": out[-3000:]}
    return {"status": status, "seconds": took, "result": result, **tail}
