"""`python -m benchmarks.run --quick` end to end, the GPU mode's arithmetic (on CPU), and
benchmarks/gpu_check.sh's dry run (the GPU check rehearsed on this CPU).

Numbers are machine-dependent: this checks that every part ran and produced positive values,
not that any target ratio is met.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from benchmarks.common import child_env
from benchmarks.gpu import gpt_benchmark, is_oom, largest_fitting, mfu, peak_flops_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quick_run_writes_a_complete_report(tmp_path):
    env = child_env()
    r = subprocess.run([sys.executable, "-m", "benchmarks.run", "--quick", "--skip-ddp", "--out", str(tmp_path)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)  # a hang, not a slow machine
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert (tmp_path / "report.md").read_text().startswith("# jdp benchmarks")
    assert (tmp_path / "throughput.png").stat().st_size > 0
    assert report["machine"]["devices"] == 2 and report["machine"]["cpu_count"] >= 1
    # the child kept the suite's compiler flags and chose its own device count
    flags = report["machine"]["xla_flags"]
    assert "device_count" not in flags
    assert flags.split() == [f for f in os.environ["XLA_FLAGS"].split() if "device_count" not in f]
    assert not flags or f"XLA_FLAGS={flags!r}" in (tmp_path / "report.md").read_text()

    h = report["handwritten"]
    for name in ("handwritten", "jdp_shard_map", "jdp_pmap"):
        assert h["contenders"][name]["median_step_s"] > 0
    assert h["ratio_handwritten_over_jdp_shard_map"] > 0 and h["ratio_handwritten_over_jdp_pmap"] > 0
    assert h["placed_batch"] == {"shard_map_takes_placed_arrays_without_copy": True,
                                 "pmap_takes_placed_arrays_without_copy": True}
    assert max(h["max_param_diff_vs_handwritten_after_4_steps"].values()) < 1e-4  # same step, same numbers
    assert report["ddp"] == {"skipped": "--skip-ddp"}

    t = report["train_loop"]
    assert t["train_loop_samples_per_s"] > 0 and t["step_alone_samples_per_s"] > 0
    assert t["ratio_train_loop_over_step"] > 0

    a = report["accum"]
    assert a["modes"]["every"]["gradient_allreduces_per_update"] == 4
    assert a["modes"]["last"]["gradient_allreduces_per_update"] == 1
    for mode in a["modes"].values():
        assert mode["median_step_s"] > 0 and mode["allreduce_bytes_per_update"] > 0

    rows = report["scaling"]["rows"]
    assert {r["devices"] for r in rows} == {1, 2} and not report["scaling"]["errors"]
    for row in rows:
        assert row["median_step_s"] > 0 and row["first_call_s"] > 0
        assert row["bytes_per_param"] == pytest.approx(16.0, abs=0.01)  # fp32 params + grads + Adam m, v

    dp = report["data"]
    assert dp["loader_batches_per_s"]["tokens"] > 0 and dp["char_gpt_steps_per_s_2_devices"] > 0
    assert dp["ratio_loader_tokens_over_step"] > 0 and dp["speedup_2_workers"] > 0
    small, large = dp["memory"]["10MB"], dp["memory"]["1GB"]
    assert (small["file_bytes"], large["file_bytes"]) == (10 * 2**20, 2**30)
    # RssAnon stays flat as the file grows a hundredfold: the file is never read whole.
    assert large["after_batches"] - large["after_open"] < 16 * 2**20

    z = report["zero"]
    assert z["ratio_sharded_over_replicated"] > 0 and "reduce-scatter" in z["comm_sharded"]
    memory = {(r["devices"], r["layout"]): r["bytes_per_param"] for r in z["memory"]["rows"]}
    for n in (1, 2, 4, 8):  # Adam in float32: 4 + 4 + 8/N bytes per parameter sharded, 16 replicated
        assert memory[(n, "replicated")] == pytest.approx(16.0, abs=0.01)
        if n > 1:
            assert memory[(n, "sharded")] == pytest.approx(8 + 8 / n, abs=0.01)
    assert "## 6. Optimizer state sharded (ZeRO-1)" in (tmp_path / "report.md").read_text()

    f = report["fsdp"]
    assert f["ratio_replicated_over_fsdp"] > 0 and "reduce-scatter" in f["comm_fsdp"]
    rows = {(r["devices"], r["layout"]): r for r in f["memory"]["rows"]}
    # the GPT's state between steps: Adam in float32 keeps 12 bytes per param, FSDP (4 + 8)/N of them
    assert rows[(1, "replicated")]["state_bytes_per_param"] == pytest.approx(12.0, abs=0.01)
    assert rows[(2, "fsdp")]["state_bytes_per_param"] == pytest.approx(6.0, abs=0.05)
    assert rows[(2, "fsdp")]["allocated"] < rows[(2, "replicated")]["allocated"]
    assert "## 7. Params sharded (FSDP)" in (tmp_path / "report.md").read_text()

    fl = report["fsdp_layers"]  # the per-layer part on tiny models: it runs, and the loop reduce-scatters
    assert len(fl["rows"]) == 2 and fl["slope_over_partitioner"] > 0 and fl["fsdp_layers_over_partitioner"] > 0
    assert all(row["collectives"]["fsdp_layers"]["reduce-scatter"]["count"] > 0 for row in fl["rows"])
    # the partitioner's FSDP with its residual stream pinned batch-sharded gathers less than without the pin
    assert all(row["collectives"]["partitioner"]["all-gather"]["bytes"]
               < row["collectives"]["partitioner_unpinned"]["all-gather"]["bytes"] for row in fl["rows"])
    assert all(row["peak"]["fsdp_layers"] < row["peak"]["replicated"] for row in fl["rows"])

    names = {r["ratio"] for r in report["ratios"]}
    assert {"handwritten_over_jdp_shard_map", "handwritten_over_jdp_pmap", "train_loop_over_step",
            "accum_every_over_last", "zero_sharded_over_replicated", "replicated_over_fsdp"} <= names
    assert all(r["value"] > 0 for r in report["ratios"])


def test_mfu_arithmetic():
    # 3.956e13 FLOPs in 0.01 s = 3.956e15 FLOP/s = half of 8 devices × 989e12.
    assert mfu(3.956e13, 0.01, 989e12, 8) == pytest.approx(0.5)
    assert mfu(989e12, 1.0, 989e12, 1) == pytest.approx(1.0)
    assert mfu(989e12, 1.0, 989e12, 2) == pytest.approx(0.5)
    assert mfu(1e12, 1.0, None, 1) is None and mfu(1e12, 0.0, 989e12, 1) is None
    assert peak_flops_for("NVIDIA H200") == 989e12 and peak_flops_for("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops_for("cpu") is None


def test_largest_fitting_batch_steps_down_on_oom_only():
    def attempt(batch):
        if batch > 64:
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.2GiB")
        return {"batch": batch}

    assert largest_fitting([32, 256, 64, 128], attempt) == (64, {"batch": 64}, [256, 128])
    assert is_oom(RuntimeError("RESOURCE_EXHAUSTED: ...")) and not is_oom(ValueError("shape mismatch"))
    with pytest.raises(ValueError):
        largest_fitting([8], lambda b: (_ for _ in ()).throw(ValueError("not an OOM")))
    with pytest.raises(RuntimeError, match="no batch size fits"):
        largest_fitting([8, 4], lambda b: (_ for _ in ()).throw(RuntimeError("RESOURCE_EXHAUSTED")))


def test_gpu_mode_bf16_gpt_step_runs_on_cpu():
    """The GPU path's bf16-compute step on a tiny GPT over the 8 fake CPU devices (no peak: MFU None)."""
    out = gpt_benchmark(d_model=32, n_layers=1, n_heads=2, context=16, vocab=32, batch_candidates=(16, 8),
                        steps=2, repeats=1, log=lambda *a: None)
    assert out["global_batch"] == 16 and out["oom_batches"] == []
    assert out["median_step_s"] > 0 and out["tokens_per_s"] > 0 and np.isfinite(out["final_loss"])
    # nanoGPT's count of the model, not the compiled program's: N = 14,816 params without the position
    # embedding (token embedding 1,024, one block 12,704, final LayerNorm 64, head 1,024), T = 16
    assert out["flops_per_step"] == (6 * 14_816 + 12 * 1 * 32 * 16) * 16 * 16 and out["mfu"] is None
    assert out["flops_source"] == "gpt: 6N+12LHQT"


def test_largest_fitting_reports_each_try():
    def attempt(batch):
        if batch > 8:
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory")
        return {}

    tries = []
    assert largest_fitting([4, 16, 8], attempt, lambda b, outcome, s: tries.append((b, outcome)))[0] == 8
    assert tries == [(16, "out of memory"), (8, "fits")]


def test_gpu_check_sizes_and_pytest_outcomes():
    from benchmarks.gpu_check_cmds import TESTS, markdown_rows, pytest_outcomes
    from benchmarks.gpu_parts import DRY, full_plan

    plan = full_plan()  # configs/gpt2_small.yaml's model: GPT-2 small
    assert {k: plan.gpt[k] for k in ("d_model", "n_layers", "n_heads", "context")} == {
        "d_model": 768, "n_layers": 12, "n_heads": 12, "context": 1024}
    assert plan.deadline_s <= 450  # the GPU machine's 8 minutes; a dry run's limits only guard a hang
    assert DRY.deadline_s >= 1800 and min(DRY.budgets.values()) >= 600
    assert all(os.path.exists(os.path.join(ROOT, f)) for f, *_ in TESTS) and TESTS[0][3]  # the dry run takes the first
    cut_off = "collected 5 items / 1 deselected / 4 selected\ntests/x.py::a PASSED [ 25%]\ntests/x.py::b[1 2] FAILED\n"
    assert pytest_outcomes(cut_off) == {"passed": 1, "failed": 1, "not run": 2}  # stopped at its time limit
    assert pytest_outcomes("collected 2 items\ntests/x.py::a PASSED\ntests/x.py::b SKIPPED (no torch)\n") == {
        "passed": 1, "skipped": 1, "not run": 0}
    table = "cpu\n\n| model | tokens/s |\n|---|---|\n| a | 1,000 |\nend"
    assert markdown_rows(table) == [{"model": "a", "tokens/s": "1,000"}]


def test_gpu_check_batch_search_bisects_on_compiled_bytes():
    """The largest batch from compiled bytes alone: the linear guess, then halving between a batch that
    fits and one that does not, down to the quantum; no compile past the deadline."""
    import time

    from benchmarks.gpu_check_parts import next_probe, search

    need = lambda b: 1000 + 30 * b + (400 if b > 150 else 0)  # noqa: E731 - not linear: the guess overshoots
    sizes = {"probes": (8, 16), "quantum": 8, "max_compiles": 10}
    seen = []
    best = search(lambda b: (need(b), 0.0), lambda p: 7000.0, sizes, time.perf_counter() + 60, 0.0,
                  lambda b, m, s: seen.append(b))
    assert need(best) <= 7000 < need(best + 8) and seen[:3] == [8, 16, 200], (best, seen)
    assert next_probe({8: 1240, 16: 1480}, 7000.0, 8) == 200  # (7000 - 1000) / 30, down to a multiple of 8
    assert next_probe({8: 1240, 184: 6520, 192: 7160}, 7000.0, 8) is None  # a quantum apart: found
    late = search(lambda b: (need(b), 5.0), lambda p: 7000.0, sizes, time.perf_counter() + 1, 0.0, lambda *a: None)
    assert late == 8  # the first compile took 5 s: none more fits in the 1 s left


def test_gpu_check_dry_run_leaves_a_number_in_every_part(tmp_path):
    """benchmarks/gpu_check.sh --dry-run: every part of the full check on this CPU (tiny GPT, one device),
    one report whose summary has a number, or one line saying why none, for each part."""
    from benchmarks.gpu_check_report import ORDER

    out = tmp_path / "report.md"
    env = {**os.environ, "JDP_PYTHON": sys.executable}
    r = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_check.sh"), "--dry-run", "--out", str(out)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1900)  # a hang, not a slow machine
    assert r.returncode == 0 and f"report written to {out}" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]
    text = out.read_text()
    assert text.startswith("# jdp GPU check (dry)") and "DRY RUN on a CPU" in text
    assert "Install: nothing to install: jdp's requirements are all there" in text
    parts = json.loads(text.split("```json\n")[1].split("\n```")[0])["parts"]
    side = "not run: benchmarks.gpu_side_by_side is not in this checkout"  # until that benchmark lands
    assert set(parts) == set(ORDER) and all(p["status"] in ("ok", side) for p in parts.values()), parts
    summary = text.split("## Summary")[1].split("\n## ")[0]
    rows = [line.split(" | ") for line in summary.splitlines()[4:] if line.startswith("| ")]
    assert len(rows) == len(ORDER) and all(any(c.isdigit() for c in row[3]) or side in row[3] for row in rows), summary
    assert parts["env"]["result"]["backend"] == "cpu" and len(parts["env"]["result"]["devices"]) == 1
    files = [f for f in parts["tests"]["result"]["files"] if "seconds" in f]
    assert files and all(f["passed"] > 0 and not f.get("failed") and not f.get("not run") for f in files)
    bench = parts["throughput"]["result"]
    assert {p: b["precision"] for p, b in bench.items()} == {"float32": "float32", "bfloat16": "bfloat16"}
    assert all(b["tokens_per_s"] > 0 and b["mfu"] is None for b in bench.values())  # no peak for a CPU
    fit = parts["fit"]["result"]["remat on"]  # the pretend limit (3x the second probe) made it bisect
    fits = [p["batch"] for p in fit["probes"] if p["bytes"] <= fit["limit_bytes"]]
    over = [p["batch"] for p in fit["probes"] if p["bytes"] > fit["limit_bytes"]]
    assert fit["global_batch"] == max(fits) > 4 and over and min(over) == fit["global_batch"] + 2, fit  # quantum 2
    assert fit["timed"]["tokens_per_s"] > 0 and fit["timed"]["steps"] == 1
    runs = parts["exactness"]["result"]["runs"]
    assert runs["sgd: bfloat16 compute"]["vs_float32_here"] > 1e-5  # bf16 compute rounds
    assert runs["sgd: float32, default matmul precision"]["vs_float32_here"] == 0.0  # CPU: highest is the default
    comm = parts["cpu_bf16_comm"]["result"]
    assert comm["platform"] == "CPU, fake devices" and comm["program_allreduce_bytes"]["bfloat16"] < \
        comm["program_allreduce_bytes"]["float32"]
    layouts = parts["layouts"]["result"]["runs"]["2"]  # compiled for 2 fake CPU devices
    assert set(layouts) == {"replicated", "zero1", "fsdp", "jit", "model"} and "error" not in str(layouts), layouts
    assert layouts["fsdp"]["collectives"]["reduce-scatter"]["count"] == 1 and layouts["fsdp"]["collectives"][
        "all-gather"]["count"] > 1 and layouts["replicated"]["collectives"]["all-gather"]["count"] == 0
    assert parts["decode"]["result"]["rows"] and "## (f) Decoding speed" in text


def test_global_view_quick_writes_the_side_by_side_table(tmp_path):
    """`python -m benchmarks.global_view --quick`: every model x layout row, both backends' reports,
    and the two backends' params agree (no timing asserted: the ratio is machine-dependent)."""
    out = tmp_path / "global_view.md"
    r = subprocess.run([sys.executable, "-m", "benchmarks.global_view", "--quick", "--out", str(out)], cwd=ROOT,
                       env=child_env(), capture_output=True, text=True, timeout=900)  # a hang, not a slow machine
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    rows = [line.split(" | ") for line in out.read_text().splitlines() if line.startswith(("| MLP", "| GPT"))]
    assert [(row[0][2:], row[1]) for row in rows] == [(model, layout) for model in ("MLP 64-128-10", "GPT 1x16")
                                                       for layout in ("replicated", "zero1", "fsdp")]
    for row in rows:
        assert "all-reduce" in row[4] and "all-reduce" in row[5] and float(row[8]) > 0
        assert float(row[9]) <= 1e-3  # jit vs shard_map after 2 Adam steps: rounding, not another step
    assert all("reduce-scatter" in row[4] for row in rows if row[1] != "replicated")  # jdp's own, per device


def test_the_partitioners_pinned_forward_is_the_gpts():
    """benchmarks.fsdp_layers pins the residual stream of the partitioner's GPT through its own forward:
    the same logits as the model's, with the pin, on 8 devices."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from benchmarks.fsdp_layers import _batch, _model, pinned_logits

    model, g = _model("q1", abstract=False)
    tokens = _batch(g, 2, False)["x"]
    mesh = Mesh(jax.devices()[:8], ("data",))
    pin = lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P("data")))  # noqa: E731
    got = jax.jit(lambda m, t: pinned_logits(m, t, pin))(model, tokens)
    np.testing.assert_allclose(got, model(tokens, train=False), rtol=1e-5, atol=1e-5)


def test_gpu_side_by_side_dry_run_runs_every_row_and_writes_its_report(tmp_path):
    """benchmarks.gpu_side_by_side --dry-run: every row end to end on this CPU (tiny GPT-2), report.json and
    report.md; the jax rows start from one init and see the same tokens, so they end at one loss."""
    import importlib.util

    rows = "jdp,jit,nanogpt,jdp_fused_xent" if importlib.util.find_spec("torch") else "jdp,jit,jdp_fused_xent"
    r = subprocess.run([sys.executable, "-m", "benchmarks.gpu_side_by_side", "--dry-run", "--rows", rows,
                        "--fused-update", "--out", str(tmp_path)], cwd=ROOT, env=child_env(), capture_output=True,
                       text=True, timeout=1800)  # a hang, not a slow machine
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["dry_run"] and report["peak_flops"] is None  # no peak known for a CPU: no MFU
    assert list(report["rows"]) == rows.split(",") + ["jdp_fused_update"]
    for row in report["rows"].values():
        assert row["median_step_s"] > 0 and row["tokens_per_s"] > 0 and row["mfu"] is None
    losses = [report["rows"][name]["last_loss"] for name in ("jdp", "jit", "jdp_fused_xent", "jdp_fused_update")]
    np.testing.assert_allclose(losses, losses[0], rtol=1e-3)
    if "nanogpt" in report["rows"]:
        assert report["rows"]["nanogpt"]["how"].startswith("eager (torch.compile not used: no CUDA device)")
    assert report["matmul"]["flops_per_s"] > 0
    text = (tmp_path / "report.md").read_text()
    assert text.startswith("# GPT-2 side by side (dry run: tiny sizes)") and "| jdp_fused_xent |" in text
