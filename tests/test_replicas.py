"""check_replicas: silent on healthy state, names the leaf and device on a corrupted one."""
import jax
import numpy as np
import optax
import pytest

import jdp
from helpers import batches, mlp_loss, mlp_params


def trained_state(backend, n=4):
    step = jdp.make_train_step(mlp_loss, optax.adam(1e-2), backend=backend, devices=jax.devices()[:n])
    state = step.init(mlp_params())
    for batch in batches(2, 16):
        state, _ = step(state, batch)
    return state


def corrupt_on_one_device(x, device_index, stacked):
    """Rebuild array `x` with one device's copy nudged by one ulp-ish amount."""
    shards = [np.array(s.data) for s in x.addressable_shards]
    shards[device_index] = shards[device_index] + np.float32(1e-6)
    arrays = [jax.device_put(a, s.device) for a, s in zip(shards, x.addressable_shards)]
    return jax.make_array_from_single_device_arrays(x.shape, x.sharding, arrays)


@pytest.mark.parametrize("backend", ["shard_map", "pmap"])
def test_healthy_state_passes(backend):
    state = trained_state(backend)
    assert jdp.replica_mismatches(state) == []
    jdp.check_replicas(state)


@pytest.mark.parametrize("backend", ["shard_map", "pmap"])
def test_corrupted_leaf_is_named(backend):
    state = trained_state(backend)
    mu = state.opt_state[0].mu
    bad_mu = dict(mu, l1=dict(mu["l1"], w=corrupt_on_one_device(mu["l1"]["w"], 2, state.stacked)))
    bad = state.replace(opt_state=(state.opt_state[0]._replace(mu=bad_mu), *state.opt_state[1:]))
    problems = jdp.replica_mismatches(bad)
    assert len(problems) == 1
    assert "mu['l1']['w']" in problems[0] and "device 2" in problems[0]
    with pytest.raises(jdp.ReplicaMismatchError, match=r"mu\['l1'\]\['w'\]: device 2 differs from device 0"):
        jdp.check_replicas(bad)
