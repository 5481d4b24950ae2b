"""`jdp explain`: the seed numbers, the matrix's verdicts, bf16 gradient communication, and the CLI's JSON."""
import io
import json
import subprocess
import sys

import numpy as np
import pytest
from rich.console import Console

from jdp.inspect import explain as ex
from jdp.inspect import explain_common as common
from jdp.inspect import explain_precision as exp

SEED_1 = {"one_device": {"grad": -8.5, "w": 1.085}, "local_grads": [-8.0, -9.0],
          "mean": {"grad": -8.5, "w": 1.085}, "sum": {"grad": -17.0, "w": 1.17}, "sum_lr_over_n": {"lr": 0.005, "w": 1.085}}
SEED_2 = {"one_device": {"grad": [-4.15, -3.85], "w": [0.915, 0.085]},
          "local_grads": [[-3.7, -3.5], [-1.7, -1.5], [-6.8, -6.0], [-4.4, -4.4]],
          "mean": {"grad": [-4.15, -3.85], "w": [0.915, 0.085]},
          "sum": {"grad": [-16.6, -15.4], "w": [2.16, 1.24]}, "sum_lr_over_n": {"lr": 0.025, "w": [0.915, 0.085]}}


def assert_seed(got, want):
    for key, value in want.items():
        if isinstance(value, dict):
            assert_seed(got[key], value)
        else:
            np.testing.assert_allclose(got[key], value, atol=1e-4, err_msg=key)


@pytest.mark.parametrize("backend", ["shard_map", "pmap"])
def test_seed_numbers(backend):
    assert_seed(ex.seed_single_param(backend), SEED_1)
    assert_seed(ex.seed_two_params(backend), SEED_2)


def test_matrix_verdicts_and_plot(tmp_path):
    rows = ex.deviation_matrix(ns=(4,), problem=ex.Problem.make(steps=2))
    ex.plot({"matrix": rows}, str(tmp_path / "m.png"))
    assert (tmp_path / "m.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    dev = {(r["optimizer"], r["clip"], r["reduction"]): r["max_abs_dparam"] for r in rows}
    assert len(dev) == 4 * 2 * 4
    for (opt, clip, red), d in dev.items():
        exact = red in ("mean", "sum + exact") or (red == "sum + auto LR" and opt in ("sgd", "momentum") and not clip)
        assert (d <= 1e-6) == exact, (opt, clip, red, d)
    assert dev[("adam", False, "sum raw")] < 1e-4 < dev[("adam", False, "sum + auto LR")]


def test_adam_eps_and_clipping_and_fp16():
    sweep = ex.adam_eps_sweep(n=4, scales=(1.0, 1e-9))
    assert sweep[0]["relative_deviation"] < 1e-3 < 0.5 < sweep[1]["relative_deviation"]
    clipping = {r["reduction"]: r["clipped_steps"] for r in ex.clipping_rates(n=4, steps=5)}
    assert clipping == {"mean": 0, "sum raw": 5, "sum + auto LR": 5, "sum + exact": 0}
    f = ex.fp16_overflow()
    assert np.isinf(f["psum"]) and np.isinf(f["lax_pmean"])
    np.testing.assert_allclose(f["jdp_mean_divide_first"], f["true_mean"], rtol=2e-3)


def test_cli_json(monkeypatch, capsys):
    """`jdp explain --json` end to end: the real CLI and the real `explain`, on a smaller grid.

    The full report compiles ~60 steps (~35 s); here the matrix keeps SGD only, the ε sweep one
    scale and the clipping count two steps. Every section of the report is still computed.
    """
    import jdp.run.cli

    specs, sweep, rates = ex.matrix_specs, ex.adam_eps_sweep, ex.clipping_rates
    monkeypatch.setattr(ex, "matrix_specs", lambda clip: {k: v for k, v in specs(clip).items() if k[0] == "sgd"})
    monkeypatch.setattr(ex, "adam_eps_sweep", lambda n, backend, progress: sweep(n, (1.0,), backend, progress=progress))
    monkeypatch.setattr(ex, "clipping_rates", lambda n, backend, progress: rates(n, 2, backend, progress=progress))
    bf16 = exp.bf16_communication
    monkeypatch.setattr(exp, "bf16_communication",
                        lambda ns, backend, progress: bf16(ns, backend, optimizers=("sgd",), progress=progress))
    assert jdp.run.cli.main(["explain", "--json", "--devices", "2"]) == 0
    out, err = capsys.readouterr()
    results = json.loads(out)  # stdout is the JSON document and nothing else
    # every part that runs several things reports each as it starts, saying what it does
    for line in ("part 3 of 8: deviation matrix, 2 of 2 (sgd, clip on)",
                 "part 4 of 8: bf16 gradient communication, 1 of 3 (sgd, all-reduce in float32, N = 2)",
                 "part 4 of 8: bf16 gradient communication, 2 of 3 (sgd, all-reduce in bfloat16, N = 1, 2)",
                 "part 4 of 8: bf16 gradient communication, 3 of 3 (the lowered program's all-reduce bytes at N = 2)",
                 "part 5 of 8: Adam ε sweep, 1 of 1 (loss × 1, mean and raw sum on 2 devices)",
                 "part 6 of 8: clipping rates, 4 of 4 (sum + exact, 2 steps on 2 devices)"):
        assert f"jdp explain: {line}\n" in err, err
    assert set(results) >= {"seed_single_param", "seed_two_params", "matrix", "adam_eps", "clipping", "fp16",
                            "bf16_comm", "conclusion", "backend"}
    assert_bf16_costs_rounding(results["bf16_comm"])
    assert {(r["reduce_dtype"], r["devices"]) for r in results["bf16_comm"]["rows"]} == {
        ("float32", 2), ("bfloat16", 1), ("bfloat16", 2)}
    assert_seed(results["seed_single_param"], SEED_1)
    assert_seed(results["seed_two_params"], SEED_2)
    assert results["backend"] == "shard_map" and results["conclusion"].startswith("Averaging")
    dev = {(r["clip"], r["reduction"]): r["max_abs_dparam"] for r in results["matrix"]}
    assert {r["devices"] for r in results["matrix"]} == {2} and len(dev) == 2 * 4
    for (clip, red), d in dev.items():
        assert (d <= 1e-6) == (red in ("mean", "sum + exact") or (red == "sum + auto LR" and not clip)), (clip, red, d)
    assert results["adam_eps"][0]["relative_deviation"] < 1e-3
    assert {r["reduction"]: r["clipped_steps"] for r in results["clipping"]} == {
        "mean": 0, "sum raw": 2, "sum + auto LR": 2, "sum + exact": 0}
    np.testing.assert_allclose(results["fp16"]["jdp_mean_divide_first"], results["fp16"]["true_mean"], rtol=2e-3)
    tokens = {r["run"]: r["max_abs_dparam"] for r in results["tokens"]["runs"]}
    assert len(set(results["tokens"]["tokens_per_device"])) > 1  # the counts differ between devices
    for run, d in tokens.items():  # only the global token mean (jdp.Weighted) is one device's step
        assert (d <= 1e-6) == run.startswith("jdp.Weighted") and (d <= 1e-6 or d > 1e-4), (run, d)
    console = Console(file=io.StringIO(), width=80)
    ex.render(results, console)  # the tables, from the JSON document as printed, in 80 columns
    text = console.file.getvalue()
    assert "bf16 gradient communication" in text and "Conclusion." in text
    assert "…" not in text and max(map(len, text.splitlines())) <= 80


# bf16 keeps 8 significant bits: each rounding is within 2^-8 of the value. A step's all-reduced
# gradient is rounded twice (each device's cast to bf16, the sum's cast; dividing by N = 2^k is
# exact), so it is within 2^-7 of the local gradients' size; Adam divides m by √v, both built from
# the rounded gradient, which can double that. After K steps the params are then off by at most
# ~2^-6 of how far they moved (measured: 0.3% SGD, 0.8% Adam). A silently ignored reduce_dtype
# would leave float32's ~1e-7 instead of ~1e-4, and the program's all-reduce bytes unchanged.
BF16_RELATIVE_BOUND = 4 * exp.BF16_UNIT_ROUNDOFF


def assert_bf16_costs_rounding(section):
    by = {(r["optimizer"], r["reduce_dtype"], r["devices"]): r for r in section["rows"]}
    for (opt, dtype, n), r in by.items():
        if dtype == "float32":
            assert r["max_abs_dparam"] <= 1e-5, (opt, n, r)
        else:
            assert 1e-5 < r["max_abs_dparam"] and r["relative"] <= BF16_RELATIVE_BOUND, (opt, n, r)
            if n > 1:
                assert r["max_abs_dparam"] > 100 * by[(opt, "float32", n)]["max_abs_dparam"], (opt, n)
    sent = section["program_allreduce_bytes"]
    n_params = sum(np.size(p) for p in ex.Problem.make().params.values())
    assert sent["float32"] - sent["bfloat16"] == 2 * n_params  # the gradient travels in 2 bytes, not 4


def test_bf16_communication_costs_bf16_rounding_and_float32_nothing():
    section = exp.bf16_communication(ns=(4,))
    assert {r["optimizer"] for r in section["rows"]} == {"sgd", "adam"} and section["steps"] == 3
    assert_bf16_costs_rounding(section)
    assert min(section["movement"].values()) > 0.01  # the params moved: the ratio is not 0 / 0


def test_bf16_check_fails_when_reduce_dtype_is_ignored(monkeypatch):
    """The checks above catch a step that drops reduce_dtype: its "bf16" runs are float32 ones."""
    real = common.make_train_step
    monkeypatch.setattr(common, "make_train_step", lambda *a, reduce_dtype=None, **k: real(*a, **k))
    common.cached_step.cache_clear()
    try:
        section = exp.bf16_communication(ns=(2,), optimizers=("sgd",))
    finally:
        common.cached_step.cache_clear()  # no step built without reduce_dtype outlives this test
    with pytest.raises(AssertionError):
        assert_bf16_costs_rounding(section)


def test_reduce_dtype_float32_is_the_float32_step():
    """The section's float32 column reuses the matrix's steps (reduce_dtype None): the same numbers."""
    problem, spec = ex.Problem.make(steps=2), ex.matrix_specs(1.0)[("adam", False)]
    cast, _ = common.train_problem(problem, spec, "mean", None, 4, reduce_dtype="float32")
    own, _ = common.train_problem(problem, spec, "mean", None, 4)
    assert common.max_abs_diff(cast, own) == 0.0


def test_cli_rejects_bad_plot_path():
    r = subprocess.run([sys.executable, "-m", "jdp.run.cli", "explain", "--plot", "out.txt"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "must name a .png file" in r.stderr and "Traceback" not in r.stderr


def test_explain_under_jit_runs_the_seed_and_says_the_per_device_parts_are_skipped(monkeypatch, capsys):
    """`jdp explain --backend jit`: the seed's one-device and mean rows come from the jit step (the
    numbers worked by hand), the psum rows and the parts that compare per-device reductions are
    skipped in one line each (a psum under jit would be refused), the rest runs."""
    import jdp.run.cli

    monkeypatch.setattr(ex, "deviation_matrix", lambda ns, backend, progress=None: [
        {"optimizer": "sgd", "clip": False, "clip_norm": None, "reduction": "mean", "devices": 2,
         "max_abs_dparam": 0.0}])
    monkeypatch.setattr(ex.explain_tokens, "token_normalisations", lambda n, progress=None, backend="shard_map": {
        "devices": n, "rows": 0, "tokens_per_device": [], "steps": 0, "reference_loss": 0.0, "runs": []})
    assert jdp.run.cli.main(["explain", "--json", "--devices", "2", "--backend", "jit"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert results["backend"] == "jit"
    seed = results["seed_single_param"]
    assert "sum" not in seed and "sum_lr_over_n" not in seed
    assert_seed(seed, {key: SEED_1[key] for key in ("one_device", "local_grads", "mean")})
    assert_seed(results["seed_two_params"], {key: SEED_2[key] for key in ("one_device", "local_grads", "mean")})
    assert all(results[key] == {"skipped": ex.SKIPPED_UNDER_JIT} for key in ex.PER_DEVICE_PARTS)
    console = Console(file=io.StringIO(), width=200)
    ex.render(results, console)
    text = console.file.getvalue()
    assert "fp16 overflow: skipped under backend='jit'" in text and "sum (psum): skipped under backend='jit'" in text
    assert "Adam (ε" not in text and "Clipping:" not in text


def test_token_normalisations_under_jit_the_batchs_own_count_is_exact():
    """Under backend="jit" the loss divided by its batch's own count is the global token mean on N
    devices; dividing each micro-batch by its own count still is not; the psum runs are left out."""
    from jdp.inspect import explain_tokens

    runs = {r["run"]: r["max_abs_dparam"] for r in explain_tokens.token_normalisations(4, backend="jit")["runs"]}
    assert list(runs) == [explain_tokens.JIT_LABELS[explain_tokens.RUNS[0][0]],
                          "own count per micro-batch (1 device, M=2)", "jdp.Weighted, N devices × M=2"]
    own, micro, weighted = runs.values()
    assert own <= 1e-6 and weighted <= 1e-6 and micro > 1e-3
