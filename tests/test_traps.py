"""Regression tests for the two silent-wrong-answer traps of jax 0.10: grad of replicated params under
shard_map(check_vma=True) is already summed; pmap with in_axes=None on an empty pytree shifts axes."""
import jax
import numpy as np
import optax
import pytest

import jdp
from helpers import batches, max_abs_diff, mlp_loss, mlp_params, reference_run

N = 4
DATA = batches(1, 16)


def test_shard_map_check_vma_grad_is_local_then_averaged():
    """With check_vma=True, grad w.r.t. replicated params is already summed over the axis.

    jdp casts params to per-device values first; SGD (which, unlike Adam, shows the scale) must
    match the one-device step exactly.
    """
    ref, _ = reference_run(mlp_loss, optax.sgd(0.1), mlp_params(), DATA)
    step = jdp.make_train_step(mlp_loss, optax.sgd(0.1), backend="shard_map", devices=jax.devices()[:N])
    state, _ = step(step.init(mlp_params()), DATA[0])
    assert max_abs_diff(jdp.get_params(state), ref) <= 1e-6


def test_shard_map_without_pcast_would_step_n_times_too_far():
    """The trap itself, in a hand-written shard_map: without the cast, pmean of the gradient is N×.

    The real step's guard is the test above (SGD equals one device); this one shows the guard is
    load-bearing in today's JAX, without touching jdp's code.
    """
    mesh = jdp.make_mesh(jax.devices()[:N])
    spec = jax.sharding.PartitionSpec

    def reduced_grad(cast):
        def per_device(params, batch):
            if cast:
                params = jax.lax.pcast(params, jdp.DATA_AXIS, to="varying")
            return jax.lax.pmean(jax.grad(mlp_loss)(params, batch), jdp.DATA_AXIS)

        mapped = jax.shard_map(per_device, mesh=mesh, in_specs=(spec(), spec(jdp.DATA_AXIS)), out_specs=spec(),
                               check_vma=True)
        return jax.jit(mapped)(mlp_params(), DATA[0])

    true = jax.grad(mlp_loss)(mlp_params(), DATA[0])  # one device, the whole batch
    for uncast, cast, want in zip(*(jax.tree.leaves(t) for t in (reduced_grad(False), reduced_grad(True), true))):
        np.testing.assert_allclose(uncast, N * np.asarray(want), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(cast, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_pmap_with_empty_optimizer_state(n):
    """optax.sgd's state has no leaves; `in_axes=None` on it would shift the batch leaves' axes.

    jdp maps every argument on axis 0. A batch of several leaves with different trailing shapes
    must still reach the loss intact.
    """
    assert jax.tree.leaves(optax.sgd(0.1).init(mlp_params())) == []
    data = batches(3, 8 * n, seed=7)
    ref, ref_losses = reference_run(mlp_loss, optax.sgd(0.1), mlp_params(), data)
    step = jdp.make_train_step(mlp_loss, optax.sgd(0.1), backend="pmap", devices=jax.devices()[:n])
    state = step.init(mlp_params())
    losses = []
    for batch in data:
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    assert max_abs_diff(jdp.get_params(state), ref) <= 1e-6
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
