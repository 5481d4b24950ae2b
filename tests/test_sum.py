"""reduction="sum": exact where the math is linear, and exactly where (and why) it is not."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdp
from helpers import batches, max_abs_diff, mlp_loss, mlp_params

BACKENDS = ["shard_map", "pmap"]
N = 4
DATA = batches(3, 32, seed=3)


def run(optimizer, reduction="mean", lr_correction=None, backend="shard_map", n=N, data=DATA, loss=mlp_loss,
        params=None):
    step = jdp.make_train_step(loss, optimizer, backend=backend, reduction=reduction,
                               lr_correction=lr_correction, devices=jax.devices()[:n])
    state = step.init(mlp_params() if params is None else params)
    norms = []
    for batch in data:
        state, m = step(state, batch)
        norms.append(float(m["grad_norm"]))
    return jdp.get_params(state), norms


def delta(after, before=None):
    before = mlp_params() if before is None else before
    return jax.tree.map(lambda a, b: np.asarray(a, np.float64) - np.asarray(b, np.float64), after, before)


def ratio_of_norms(a, b):
    return float(optax.tree.norm(a) / optax.tree.norm(b))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("opt", [optax.sgd(0.1), optax.sgd(0.1, momentum=0.9)], ids=["sgd", "momentum"])
def test_sum_with_auto_correction_equals_mean_for_linear_optimizers(backend, opt):
    mean, _ = run(opt, backend=backend)
    auto, _ = run(opt, "sum", "auto", backend=backend)
    assert max_abs_diff(mean, auto) <= 1e-6


@pytest.mark.parametrize("backend", BACKENDS)
def test_raw_sum_makes_the_sgd_step_n_times_larger(backend):
    mean, mean_norms = run(optax.sgd(0.1), backend=backend, data=DATA[:1])
    raw, raw_norms = run(optax.sgd(0.1), "sum", "none", backend=backend, data=DATA[:1])
    for r, m in zip(jax.tree.leaves(delta(raw)), jax.tree.leaves(delta(mean))):
        np.testing.assert_allclose(r, N * m, rtol=1e-5, atol=5e-7)  # float32 params: ~1 ulp
    np.testing.assert_allclose(raw_norms, N * np.array(mean_norms), rtol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_auto_correction_makes_adam_steps_n_times_smaller(backend):
    mean, _ = run(optax.adam(1e-2), backend=backend, data=DATA[:1])
    auto, _ = run(optax.adam(1e-2), "sum", "auto", backend=backend, data=DATA[:1])
    # Adam's first step is lr·g/(|g|+ε) per coordinate: independent of the gradient's scale, so
    # dividing the LR by N divides the step by N.
    np.testing.assert_allclose(ratio_of_norms(delta(mean), delta(auto)), N, rtol=1e-3)


def test_raw_sum_under_adam_is_close_to_mean_except_near_eps():
    mean, _ = run(optax.adam(1e-2))
    raw, _ = run(optax.adam(1e-2), "sum", "none")
    moved = max_abs_diff(mean, mlp_params())
    assert max_abs_diff(mean, raw) <= 1e-3 * moved  # |g| >> ε almost everywhere: Adam ignores the N×

    def tiny_loss(params, batch):  # gradients of order 1e-9, comparable to ε = 1e-8
        return 1e-8 * mlp_loss(params, batch)

    mean, _ = run(optax.adam(1e-2), loss=tiny_loss)
    raw, _ = run(optax.adam(1e-2), "sum", "none", loss=tiny_loss)
    moved = max_abs_diff(mean, mlp_params())
    assert max_abs_diff(mean, raw) > 0.2 * moved  # the sum's step differs by a large fraction


@pytest.mark.parametrize("backend", BACKENDS)
def test_clipping_sees_an_n_times_norm_under_sum(backend):
    _, mean_norms = run(optax.sgd(0.1), backend=backend, data=DATA[:1])
    c = 2.0 * mean_norms[0]  # mean never clips at this threshold; the N× sum always does
    clipped = optax.chain(optax.clip_by_global_norm(c), optax.sgd(0.1))
    mean, _ = run(clipped, backend=backend, data=DATA[:1])
    auto, auto_norms = run(clipped, "sum", "auto", backend=backend, data=DATA[:1])
    unclipped, _ = run(optax.sgd(0.1), backend=backend, data=DATA[:1])
    assert max_abs_diff(mean, unclipped) <= 1e-7
    np.testing.assert_allclose(auto_norms[0], N * mean_norms[0], rtol=1e-6)
    # sum + auto: the N× gradient is clipped to norm c, then scaled by 1/N: a step of norm c·lr/N.
    np.testing.assert_allclose(optax.tree.norm(delta(auto)), 0.1 * c / N, rtol=1e-4)
    np.testing.assert_allclose(ratio_of_norms(delta(mean), delta(auto)), N / 2, rtol=1e-4)


def test_adamw_weight_decay_is_scaled_by_the_lr_correction():
    def zero_loss(params, batch):  # no gradient: the whole update is the decoupled weight decay
        return 0.0 * mlp_loss(params, batch)

    opt = optax.adamw(1e-2, weight_decay=0.5)
    mean, _ = run(opt, loss=zero_loss, data=DATA[:1])
    auto, _ = run(opt, "sum", "auto", loss=zero_loss, data=DATA[:1])
    for m, a, p in zip(jax.tree.leaves(delta(mean)), jax.tree.leaves(delta(auto)), jax.tree.leaves(mlp_params())):
        np.testing.assert_allclose(m, -1e-2 * 0.5 * p, rtol=1e-5, atol=1e-7)  # float32 params: ~1 ulp
        np.testing.assert_allclose(a, m / N, rtol=1e-5, atol=1e-7)


# Adam's ε = 1e-3, near |g|: an exact correction that forgot ε × N is off by 7.7e-3 (with the default
# 1e-8, by 2.7e-6: too close to the 1e-6 tolerance to tell from rounding); done right, by 3e-8.
SPECS = [jdp.OptimizerSpec(name, lr=lr, weight_decay=wd, clip_norm=clip, eps=1e-3)
         for name, lr, wd in [("sgd", 0.1, 0.0), ("momentum", 0.1, 0.0), ("adam", 1e-2, 0.0), ("adamw", 1e-2, 0.1)]
         for clip in (None, 0.05)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.name}-clip{s.clip_norm}")
def test_exact_correction_makes_sum_equal_mean(backend, spec):
    mean, norms = run(spec, backend=backend)
    exact, _ = run(spec, "sum", "exact", backend=backend)
    assert max_abs_diff(mean, exact) <= 1e-6
    if spec.clip_norm is not None:
        assert max(norms) > spec.clip_norm  # the clipping actually engaged


def test_exact_spec_changes_only_the_scale_dependent_hyperparameters():
    s = jdp.exact_sum_spec(jdp.OptimizerSpec("adamw", lr=1e-3, eps=1e-8, weight_decay=0.1, clip_norm=1.0), 8)
    assert (s.lr, s.eps, s.weight_decay, s.clip_norm) == (1e-3, 8e-8, 0.1, 8.0)
    s = jdp.exact_sum_spec(jdp.OptimizerSpec("momentum", lr=0.8, clip_norm=None), 8)
    assert (s.lr, s.eps, s.clip_norm) == (0.1, 1e-8, None)


def test_contradictory_corrections_are_rejected():
    with pytest.raises(ValueError, match="lr_correction='auto' only applies to reduction='sum'"):
        jdp.make_train_step(mlp_loss, optax.sgd(0.1), reduction="mean", lr_correction="auto")
    with pytest.raises(ValueError, match="lr_correction='half' is not supported"):
        jdp.make_train_step(mlp_loss, optax.sgd(0.1), reduction="sum", lr_correction="half")
    with pytest.raises(ValueError, match="lr_correction='exact' needs a jdp.OptimizerSpec"):
        jdp.make_train_step(mlp_loss, optax.sgd(0.1), reduction="sum", lr_correction="exact")
    with pytest.raises(ValueError, match="optimizer name='lamb' is not supported"):
        jdp.OptimizerSpec("lamb")
    with pytest.raises(ValueError, match="weight_decay=0.1 needs name='adamw'"):
        jdp.OptimizerSpec("adam", weight_decay=0.1)


def fp16_loss(params, batch):
    """d loss / d w_j = mean(x): each device's fp16 gradient is its mean x, here 9000-9700."""
    return jnp.mean(batch["x"][:, 0] * jnp.sum(params["w"]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp16_mean_divides_before_summing(backend):
    x = np.repeat(9000.0 + 100.0 * np.arange(8), 2).astype(np.float16)  # 8 devices, 2 examples each
    step = jdp.make_train_step(fp16_loss, optax.sgd(1e-4), backend=backend, devices=jax.devices()[:8])
    state, m = step(step.init({"w": np.ones(3, np.float16)}), {"x": x[:, None]})
    assert np.float64(x.astype(np.float64).sum()) > np.finfo(np.float16).max  # a plain sum overflows
    np.testing.assert_allclose(float(m["grad_norm"]), np.sqrt(3) * x.astype(np.float64).mean(), rtol=2e-3)
    step_taken = 1.0 - jdp.get_params(state)["w"].astype(np.float64)  # lr·mean(x), in fp16 near 1.0
    np.testing.assert_allclose(step_taken, 1e-4 * x.astype(np.float64).mean(), rtol=2e-3)
    summed = jdp.make_train_step(fp16_loss, optax.sgd(1e-4), backend=backend, reduction="sum",
                                 lr_correction="none", devices=jax.devices()[:8])
    _, m = summed(summed.init({"w": np.ones(3, np.float16)}), {"x": x[:, None]})
    assert np.isinf(float(m["grad_norm"]))


def test_plain_pmean_overflows_in_fp16():
    """lax.pmean is psum then divide: the intermediate sum overflows. jdp's mean does not."""
    x = (9000.0 + 100.0 * np.arange(8)).astype(np.float16)
    mesh = jdp.make_mesh(jax.devices()[:8])
    spec = jax.sharding.PartitionSpec(jdp.DATA_AXIS)

    def reduce_with(fn):
        return np.asarray(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec)(x))

    assert np.isinf(reduce_with(lambda v: jax.lax.pmean(v, jdp.DATA_AXIS))).all()
    np.testing.assert_allclose(reduce_with(jdp.core.reduce.mean_over_devices), x.astype(np.float64).mean(), rtol=2e-3)
