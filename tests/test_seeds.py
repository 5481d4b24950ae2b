"""The seed regressions (y = w·x, MSE, one SGD step worked by hand) through the public API, on both backends.

The inputs come from `jdp.data.SEED_REGRESSIONS`; the expected numbers are written out here.
"""
import jax
import numpy as np
import optax
import pytest

import jdp
from jdp.data import SEED_REGRESSIONS, load_seed_regression

BACKENDS = ["shard_map", "pmap"]

X1, T1 = (load_seed_regression(1).arrays[k] for k in ("x", "t"))
X2, T2 = (load_seed_regression(2).arrays[k] for k in ("x", "t"))


def test_seed_inputs():
    """Seed 1: x = [2, 3, 1, 4], t = [3, 5, 2, 6], w = 1, lr = 0.01; seed 2: w = (0.5, -0.3), lr = 0.1."""
    np.testing.assert_array_equal(X1, [2, 3, 1, 4])
    np.testing.assert_array_equal(T1, [3, 5, 2, 6])
    np.testing.assert_array_equal(X2, [[1, 2], [2, 1], [.5, 1.5], [1.5, .5], [3, 1], [1, 3], [2, 2], [.5, .5]])
    np.testing.assert_array_equal(T2, [1, 2, .5, 1.5, 3, 1, 2.5, .5])
    assert [(s.w0, s.lr, s.devices) for s in SEED_REGRESSIONS.values()] == [(1.0, 0.01, 2), ((0.5, -0.3), 0.1, 4)]


def linear_loss(params, batch):
    """MSE (mean over the examples given) of y = x·w."""
    pred = batch["x"] @ params["w"] if batch["x"].ndim == 2 else batch["x"] * params["w"]
    return ((pred - batch["t"]) ** 2).mean()


def one_step(x, t, w, lr, n, backend):
    step = jdp.make_train_step(linear_loss, optax.sgd(lr), backend=backend, devices=jax.devices()[:n])
    state, metrics = step(step.init({"w": np.asarray(w, np.float32)}), {"x": x, "t": t})
    return jdp.get_params(state)["w"], jax.device_get(metrics)


@pytest.mark.parametrize("backend", BACKENDS)
def test_seed_single_param(backend):
    # One device, batch 4: grad -8.5, w -> 1.085.
    w1, m1 = one_step(X1, T1, 1.0, 0.01, 1, backend)
    np.testing.assert_allclose(w1, 1.085, rtol=1e-6)
    np.testing.assert_allclose(m1["grad_norm"], 8.5, rtol=1e-6)
    # Each device alone on its half: local grads -8.0 and -9.0 (recovered from w' = w - lr·g).
    local = [(1.0 - one_step(X1[s], T1[s], 1.0, 0.01, 1, backend)[0]) / 0.01 for s in (slice(0, 2), slice(2, 4))]
    np.testing.assert_allclose(local, [-8.0, -9.0], rtol=1e-5)
    # Two devices, mean reduction: the same step as one device on the whole batch.
    w2, m2 = one_step(X1, T1, 1.0, 0.01, 2, backend)
    np.testing.assert_allclose(w2, 1.085, rtol=1e-6)
    np.testing.assert_allclose(m2["grad_norm"], 8.5, rtol=1e-6)
    np.testing.assert_allclose(m2["loss"], np.mean((X1 - T1) ** 2), rtol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_seed_two_params(backend):
    w, m = one_step(X2, T2, [0.5, -0.3], 0.1, 4, backend)
    np.testing.assert_allclose(w, [0.915, 0.085], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m["grad_norm"], np.hypot(4.15, 3.85), rtol=1e-5)
    np.testing.assert_allclose(m["loss"], np.mean((X2 @ [0.5, -0.3] - T2) ** 2), rtol=1e-6)
    local = [(np.array([0.5, -0.3]) - one_step(X2[2 * i:2 * i + 2], T2[2 * i:2 * i + 2], [0.5, -0.3], 0.1, 1,
                                               backend)[0]) / 0.1 for i in range(4)]
    np.testing.assert_allclose(local, [[-3.7, -3.5], [-1.7, -1.5], [-6.8, -6.0], [-4.4, -4.4]], rtol=1e-5)
