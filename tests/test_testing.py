"""jdp.testing: the pytest plugin (fake devices before any conftest imports jax) and
assert_data_parallel_exact (passes for exact steps, fails with the per-leaf report for wrong ones)."""
import pathlib
import subprocess
import sys
import textwrap
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from benchmarks.common import child_env
from helpers import batches, mlp_logits, mlp_loss, mlp_loss_acc, mlp_params
from jdp.testing import (TOLERANCES, NotExactError, assert_data_parallel_exact, default_tolerance,
                         requested_devices)

ROOT = pathlib.Path(__file__).resolve().parents[1]
FOUR = jax.devices()[:4]


def run_pytest(cwd, *args, extra_env=None):
    """pytest in a fresh process, with none of this suite's device settings."""
    env = child_env("XLA_FLAGS", "JAX_PLATFORMS", "PYTEST_ADDOPTS", **(extra_env or {}))
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs", *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


# --- assert_data_parallel_exact -------------------------------------------------------------


def test_exact_steps_pass_and_the_report_lists_every_leaf_of_every_run():
    report = assert_data_parallel_exact(mlp_loss_acc, optax.adam(1e-2), mlp_params(), batches(3, 32), devices=FOUR,
                                        has_aux=True, accum_steps=2)
    assert report.ok and report.devices == 4 and report.steps == 3
    assert report.runs == ("shard_map, accum_sync='every'", "shard_map, accum_sync='last'",
                           "pmap, accum_sync='every'", "pmap, accum_sync='last'")
    names = {f"params.l{i}.{k}" for i in range(3) for k in "wb"} | {"loss", "aux.accuracy"}
    assert sorted((r.run, r.name) for r in report.rows) == sorted((run, name) for run in report.runs for name in names)
    ratios = [r.ratio for r in report.rows]
    assert ratios == sorted(ratios, reverse=True)  # worst first
    assert all(r.moved > 10 * r.tol for r in report.rows if r.name.startswith("params"))
    text = str(report)
    assert "0 of 32 leaves beyond tolerance" in text and "params.l0.w" in text and "FAIL" not in text


def test_nnx_model_with_batchnorm_passes_and_is_left_as_it_was():
    class Tiny(nnx.Module):
        def __init__(self, *, rngs):
            self.linear = nnx.Linear(12, 8, use_bias=False, rngs=rngs)
            self.bn = nnx.BatchNorm(8, rngs=rngs)
            self.head = nnx.Linear(8, 5, rngs=rngs)

        def __call__(self, x):
            return self.head(nnx.relu(self.bn(self.linear(x))))

    def loss_fn(model, batch):
        return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"]).mean()

    model = Tiny(rngs=nnx.Rngs(0))
    before = jax.tree.map(np.array, nnx.state(model))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)  # its tx is used
    report = assert_data_parallel_exact(loss_fn, optimizer, model, batches(3, 32), devices=FOUR,
                                        backends="shard_map", accum_steps=2, accum_sync="last")
    assert report.runs == ("shard_map, accum_sync='last'",)
    assert {"model_state.bn.mean", "model_state.bn.var", "params.bn.scale"} <= {r.name for r in report.rows}
    jax.tree.map(np.testing.assert_array_equal, before, nnx.state(model))

    # Per-device BatchNorm statistics (PyTorch DDP without SyncBatchNorm) are not one device's steps.
    with pytest.raises(NotExactError) as failed:
        assert_data_parallel_exact(loss_fn, optax.adam(1e-2), model, batches(3, 32), devices=FOUR,
                                   backends="shard_map", sync_batchnorm=False)
    assert {"model_state.bn.mean", "model_state.bn.var"} <= {r.name for r in failed.value.report.failures}


def summed_loss(params, batch):  # wrong: sums over the examples instead of averaging
    return optax.softmax_cross_entropy_with_integer_labels(mlp_logits(params, batch["x"]), batch["y"]).sum()


def test_a_summed_loss_fails_with_every_leaf_worst_first():
    with pytest.raises(NotExactError) as failed:
        assert_data_parallel_exact(summed_loss, optax.sgd(1e-3), mlp_params(), batches(3, 32), devices=FOUR)
    cause, message = str(failed.value).split("\n", 1)  # first the cause, measured on the first batch
    assert cause.startswith("loss_fn is not a mean over examples: on the first batch its value on the whole batch")
    assert "4 times the mean of its values on the 4 device shards" in cause
    assert message.startswith("jdp on 4 devices does not take the one-device steps: 14 of 14 leaves beyond "
                              "tolerance (worst first; runs: shard_map, pmap):")
    lines = message.splitlines()
    assert lines[1].split()[:4] == ["run", "leaf", "max|Δ|", "tolerance"]
    rows = [line.split() for line in lines[2:]]
    assert len(rows) == 14 and all(row[0] == "FAIL" for row in rows)
    assert {row[2] for row in rows} == {"loss"} | {f"params.l{i}.{k}" for i in range(3) for k in "wb"}
    ratios = [float(row[3]) / float(row[4]) for row in rows]
    assert ratios == sorted(ratios, reverse=True)
    assert failed.value.report.failures == failed.value.report.rows


def test_a_per_device_batch_statistic_fails():
    def standardized(params, batch):  # normalises by its own batch's statistics: per device under jdp
        x = (batch["x"] - batch["x"].mean(0)) / (batch["x"].std(0) + 1e-3)
        return mlp_loss(params, {"x": x, "y": batch["y"]})

    with pytest.raises(NotExactError, match=r"beyond tolerance .*\n.*\nFAIL shard_map  loss"):
        assert_data_parallel_exact(standardized, optax.sgd(0.1), mlp_params(), batches(3, 32), devices=FOUR,
                                   backends="shard_map")


def test_a_comparison_that_proves_nothing_fails():
    with pytest.raises(NotExactError, match="changed no parameter beyond its tolerance .* would pass for any step"):
        assert_data_parallel_exact(mlp_loss, optax.sgd(0.0), mlp_params(), batches(2, 32), devices=FOUR,
                                   backends="shard_map")
    f16 = lambda tree: jax.tree.map(lambda x: x.astype(np.float16) if x.dtype == np.float32 else x, tree)  # noqa: E731
    with pytest.raises(NotExactError, match="reference itself produced NaN or Inf in params.l0.b") as failed:
        assert_data_parallel_exact(mlp_loss, optax.adam(1e-2), f16(mlp_params()), [f16(b) for b in batches(2, 32)],
                                   devices=FOUR, backends="shard_map")  # Adam's eps of 1e-8 is 0 in float16
    assert failed.value.report is None


def test_tolerances_follow_the_dtype():
    assert TOLERANCES == {"float64": (1e-12, 1e-12), "float32": (1e-5, 1e-5), "float16": (2e-3, 2e-3),
                          "bfloat16": (2e-2, 2e-2)}
    assert default_tolerance(jnp.bfloat16) == (2e-2, 2e-2) and default_tolerance(np.int32) == (0.0, 0.0)
    # bfloat16 params: a few bf16 ulps apart from one device, within bf16's tolerance, far beyond float32's.
    def bf16(tree):
        return jax.tree.map(lambda x: x.astype(jnp.bfloat16) if x.dtype == np.float32 else x, tree)

    params, data = bf16(mlp_params()), [bf16(b) for b in batches(6, 64)]
    report = assert_data_parallel_exact(mlp_loss, optax.sgd(0.5), params, data, devices=FOUR, backends="shard_map")
    assert {r.dtype for r in report.rows} == {"bfloat16"}  # jdp's float32 loss too: compared at the coarser dtype
    assert max(r.diff for r in report.rows if r.name.startswith("params")) > 1e-3
    with pytest.raises(NotExactError):
        assert_data_parallel_exact(mlp_loss, optax.sgd(0.5), params, data, devices=FOUR, backends="shard_map",
                                   rtol=1e-5, atol=1e-5)


def test_bad_arguments_are_one_sentence():
    params, data = mlp_params(), batches(1, 32)
    with pytest.raises(ValueError, match="batches is empty"):
        assert_data_parallel_exact(mlp_loss, optax.sgd(0.1), params, [], devices=FOUR)
    with pytest.raises(ValueError, match="needs_rng cannot be checked against one device"):
        assert_data_parallel_exact(mlp_loss, optax.sgd(0.1), params, data, devices=FOUR, needs_rng=True)
    with pytest.raises(ValueError, match="backend is an argument of assert_data_parallel_exact itself"):
        assert_data_parallel_exact(mlp_loss, optax.sgd(0.1), params, data, devices=FOUR, backend="pmap")
    with pytest.raises(ValueError, match="optimizer must be an optax.GradientTransformation or an optax.Mu.*got str"):
        assert_data_parallel_exact(mlp_loss, "adam", params, data, devices=FOUR)
    with pytest.raises(ValueError, match=r"global batch size 32 is not accum_steps × devices × b = 3 × 4 × b"):
        assert_data_parallel_exact(mlp_loss, optax.sgd(0.1), params, data, devices=FOUR, accum_steps=3)


def test_requested_devices_reads_the_option_then_the_ini_value():
    def config(option=None, ini=""):
        return types.SimpleNamespace(option=types.SimpleNamespace(jdp_devices=option), getini=lambda name: ini)

    assert requested_devices(config()) is None
    assert requested_devices(config("4", "2")) == 4
    assert requested_devices(config(None, " 2 ")) == 2
    with pytest.raises(pytest.UsageError, match=r"--jdp-devices must be a number of devices from 1 to 4096, got '0'"):
        requested_devices(config("0"))
    with pytest.raises(pytest.UsageError, match=r"the jdp_devices ini value must be .* got 'four'"):
        requested_devices(config(None, "four"))


# --- the pytest plugin, in fresh processes -----------------------------------------------------


def test_the_example_user_test_passes_on_4_fake_devices():
    # -n0: in one process, as in a user's project (this repository's addopts ask for xdist workers)
    done = run_pytest(ROOT, "-n0", "-p", "jdp.testing", "--jdp-devices", "4", "examples/test_my_model.py", "-s")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "1 passed" in done.stdout and "jdp on 4 device(s) vs one device, 3 step(s)" in done.stdout, done.stdout


PROBE = """
    import os
    import jax
    import conftest

    def test_devices(jdp_devices):
        assert conftest.COUNT == jax.device_count() == len(jdp_devices) == int(os.environ["WANT"])
        assert jax.default_backend() == "cpu" and os.environ.get("XLA_FLAGS") is None
        assert os.environ["PJRT_NPROC"] == str(max(os.cpu_count(), 2 * jax.device_count() + 2))
"""


def test_the_option_sets_devices_before_a_conftest_computes_with_jax(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\nfilterwarnings = error\n")
    (tmp_path / "conftest.py").write_text("import jax.numpy as jnp\nCOUNT = len(jnp.ones(2).devices()) and "
                                          "__import__('jax').device_count()\n")
    (tmp_path / "test_probe.py").write_text(textwrap.dedent(PROBE))
    done = run_pytest(tmp_path, "-p", "jdp.testing", "--jdp-devices", "3", extra_env={"WANT": "3"})
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]


def test_the_ini_value_with_the_plugin_in_addopts(tmp_path):
    ini = "[pytest]\naddopts = -p jdp.testing\njdp_devices = 2\nfilterwarnings = error\n"
    (tmp_path / "pytest.ini").write_text(ini)
    (tmp_path / "conftest.py").write_text("import jax\nCOUNT = jax.device_count()\n")
    (tmp_path / "test_probe.py").write_text(textwrap.dedent(PROBE))
    done = run_pytest(tmp_path, extra_env={"WANT": "2"})
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]


def test_without_the_option_the_plugin_changes_nothing(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\nfilterwarnings = error\n")
    (tmp_path / "test_probe.py").write_text(textwrap.dedent("""
        import os
        import jax

        def test_untouched():
            assert not {"PJRT_NPROC", "JAX_PLATFORMS", "XLA_FLAGS"} & set(os.environ)
            assert jax.config.jax_num_cpu_devices == -1 and not jax.config.jax_platforms
            assert len(jax.devices("cpu")) == 1

        def test_fixture_skips(jdp_devices):
            pass
    """))
    done = run_pytest(tmp_path, "-p", "jdp.testing")
    assert done.returncode == 0 and "1 passed, 1 skipped" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    assert "only 1 jax device: run pytest with --jdp-devices N (N >= 2)" in done.stdout
