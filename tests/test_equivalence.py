"""Every data-parallel path equals plain one-device JAX on the global batch."""
import jax
import numpy as np
import optax
import pytest

import jdp
from helpers import batches, max_abs_diff, mlp_loss, mlp_params, reference_run

OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.1),
    "momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "adam": lambda: optax.adam(1e-2),
    "adamw_clip": lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2, weight_decay=0.1)),
}
DATA = batches(4, 32)
STEPS_TOL = 2e-5


@pytest.fixture(scope="module")
def references():
    return {name: reference_run(mlp_loss, make(), mlp_params(), DATA) for name, make in OPTIMIZERS.items()}


@pytest.mark.parametrize("backend", ["shard_map", "pmap"])
@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_matches_one_device(references, opt, n, backend):
    step = jdp.make_train_step(mlp_loss, OPTIMIZERS[opt](), backend=backend, devices=jax.devices()[:n])
    state = step.init(mlp_params())
    losses = []
    for batch in DATA:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    ref_params, ref_losses = references[opt]
    assert max_abs_diff(jdp.get_params(state), ref_params) <= STEPS_TOL
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    # The run actually trained: params moved well beyond the tolerance.
    assert max_abs_diff(ref_params, mlp_params()) > 100 * STEPS_TOL
    jdp.check_replicas(state)
    assert int(jdp.step.get_tree(state, state.step)) == len(DATA)
