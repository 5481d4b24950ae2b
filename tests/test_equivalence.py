"""Every data-parallel path equals plain one-device JAX on the global batch (`jdp.testing`'s check,
which users run on their own models, with this module's fixed tolerance)."""
import jax
import optax
import pytest

from helpers import batches, mlp_loss, mlp_params
from jdp.testing import assert_data_parallel_exact

OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.1),
    "momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "adam": lambda: optax.adam(1e-2),
    "adamw_clip": lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2, weight_decay=0.1)),
}
DATA = batches(4, 32)
STEPS_TOL = 2e-5


@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_matches_one_device(opt, n):
    # Both backends; per backend: params and every step's loss within STEPS_TOL of the one-device
    # reference (jit(value_and_grad) + the optax update on the whole global batch), bit-identical
    # replicas (jdp.check_replicas) and one optimizer step per global batch.
    report = assert_data_parallel_exact(mlp_loss, OPTIMIZERS[opt](), mlp_params(), DATA, devices=jax.devices()[:n],
                                        backends=("shard_map", "pmap"), rtol=0, atol=STEPS_TOL)
    assert report.runs == ("shard_map", "pmap")
    assert {r.name for r in report.rows} == {"loss"} | {f"params.l{i}.{k}" for i in range(3) for k in "wb"}
    assert all(r.diff <= 1e-5 for r in report.rows if r.name == "loss")  # losses ~1.6: within rtol 1e-5
    # The run actually trained: params moved well beyond the tolerance.
    assert max(r.moved for r in report.rows if r.name.startswith("params")) > 100 * STEPS_TOL
