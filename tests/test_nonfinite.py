"""skip_nonfinite: a NaN/Inf gradient skips the update on every device and is counted."""
import jax
import numpy as np
import optax
import pytest

import jdp
from helpers import batches, max_abs_diff, mlp_loss, mlp_params, reference_run


def poisoned(batch):
    x = batch["x"].copy()
    x[3, 0] = np.nan  # one example on one device: the reduced gradient is NaN everywhere
    return {"x": x, "y": batch["y"]}


@pytest.mark.parametrize("backend", ["shard_map", "pmap"])
@pytest.mark.parametrize("m,sync", [(1, "every"), (2, "last"), (2, "every")])
def test_nan_batch_is_skipped_and_counted(backend, m, sync):
    # With M = 2 the NaN is in the first micro-batch: the step must remember it until the update.
    good = batches(2, 16, seed=8)
    step = jdp.make_train_step(mlp_loss, optax.adam(1e-2), backend=backend, devices=jax.devices()[:4],
                               accum_steps=m, accum_sync=sync, skip_nonfinite=True)
    state = step.init(mlp_params())
    for micro in step.micro_batches(good[0]):
        state, metrics = step(state, micro)
    before = jdp.get_params(state)
    for micro in step.micro_batches(poisoned(good[1])):
        state, metrics = step(state, micro)
    assert bool(metrics["skipped"]) and not bool(metrics["updated"])
    assert max_abs_diff(jdp.get_params(state), before) == 0.0
    assert int(jdp.step.get_tree(state, state.skip_streak)) == 1 and int(jdp.step.get_tree(state, state.skipped)) == 1
    for micro in step.micro_batches(good[1]):
        state, metrics = step(state, micro)
    assert int(jdp.step.get_tree(state, state.skip_streak)) == 0 and int(jdp.step.get_tree(state, state.skipped)) == 1
    # The skipped step left no trace: the result equals a run that never saw the NaN batch.
    ref, _ = reference_run(mlp_loss, optax.adam(1e-2), mlp_params(), good)
    assert max_abs_diff(jdp.get_params(state), ref) <= 2e-5
    jdp.check_replicas(state)


def test_without_skipping_a_nan_batch_poisons_the_params():
    step = jdp.make_train_step(mlp_loss, optax.sgd(0.1), devices=jax.devices()[:4])
    state, _ = step(step.init(mlp_params()), poisoned(batches(1, 16)[0]))
    assert np.isnan(jdp.get_params(state)["l0"]["w"]).any()


