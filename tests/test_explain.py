"""`jdp explain`: the seed numbers, the matrix's verdicts, and the CLI's JSON."""
import json
import subprocess
import sys

import numpy as np
import pytest

from jdp import explain as ex

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
    import jdp.cli

    specs, sweep, rates = ex.matrix_specs, ex.adam_eps_sweep, ex.clipping_rates
    monkeypatch.setattr(ex, "matrix_specs", lambda clip: {k: v for k, v in specs(clip).items() if k[0] == "sgd"})
    monkeypatch.setattr(ex, "adam_eps_sweep", lambda n, backend="shard_map": sweep(n, scales=(1.0,), backend=backend))
    monkeypatch.setattr(ex, "clipping_rates", lambda n, backend="shard_map": rates(n, steps=2, backend=backend))
    assert jdp.cli.main(["explain", "--json", "--devices", "2"]) == 0
    results = json.loads(capsys.readouterr().out)  # stdout is the JSON document and nothing else
    assert set(results) >= {"seed_single_param", "seed_two_params", "matrix", "adam_eps", "clipping", "fp16",
                            "conclusion", "backend"}
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


def test_cli_rejects_bad_plot_path():
    r = subprocess.run([sys.executable, "-m", "jdp.cli", "explain", "--plot", "out.txt"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "must name a .png file" in r.stderr and "Traceback" not in r.stderr
