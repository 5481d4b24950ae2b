"""The step's contract beyond the numbers: no recompiles, validation, aux metrics, per-device RNG."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdp
from helpers import batches, mlp_logits, mlp_loss, mlp_loss_acc, mlp_params

BACKENDS = ["shard_map", "pmap"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_recompile_on_same_shapes(backend):
    step = jdp.make_train_step(mlp_loss, optax.adam(1e-2), backend=backend, devices=jax.devices()[:4])
    state = step.init(mlp_params())
    for batch in batches(4, 16):  # fresh host arrays every call, same shapes and dtypes
        state, _ = step(state, batch)
    assert step.trace_count == 1
    # The counter does see a new signature (so the assertion above can fail).
    other = {"x": np.zeros((16, 12), np.float32), "y": np.zeros(16, np.int8)}
    state, _ = step(state, other)
    assert step.trace_count == 2


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("size,n", [(10, 4), (6, 8), (3, 2)])
def test_indivisible_batch_names_both_numbers(backend, size, n):
    step = jdp.make_train_step(mlp_loss, optax.sgd(0.1), backend=backend, devices=jax.devices()[:n])
    state = step.init(mlp_params())
    batch = {"x": np.zeros((size, 12), np.float32), "y": np.zeros(size, np.int32)}
    with pytest.raises(ValueError, match=rf"global batch size {size} does not divide evenly across {n} devices"):
        step(state, batch)


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="backend='gspmd' is not supported"):
        jdp.make_train_step(mlp_loss, optax.sgd(0.1), backend="gspmd")
    with pytest.raises(ValueError, match="reduction='max' is not supported"):
        jdp.make_train_step(mlp_loss, optax.sgd(0.1), reduction="max")
    with pytest.raises(ValueError, match="optimizer must be an optax.GradientTransformation"):
        jdp.make_train_step(mlp_loss, lambda g: g)
    with pytest.raises(ValueError, match="devices is empty"):
        jdp.make_train_step(mlp_loss, optax.sgd(0.1), devices=[])
    with pytest.raises(ValueError, match="grad_norm='yes' must be True or False"):
        jdp.make_train_step(mlp_loss, optax.sgd(0.1), grad_norm="yes")
    step = jdp.make_train_step(mlp_loss, optax.sgd(0.1), devices=jax.devices()[:2])
    state = step.init(mlp_params())
    with pytest.raises(ValueError, match=r"disagree on the global batch size: \[8, 10\]"):
        step(state, {"x": np.zeros((8, 12), np.float32), "y": np.zeros(10, np.int32)})
    pmap_step = jdp.make_train_step(mlp_loss, optax.sgd(0.1), backend="pmap", devices=jax.devices()[:2])
    with pytest.raises(ValueError, match="state was made for the shard_map backend; this step uses 'pmap'"):
        pmap_step(state, batches(1, 8)[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_grad_norm_is_the_reduced_gradients_norm_and_optional(backend):
    devices = jax.devices()[:4]
    params, batch = mlp_params(), batches(1, 16)[0]
    with_norm = jdp.make_train_step(mlp_loss, optax.adam(1e-2), backend=backend, devices=devices)
    without = jdp.make_train_step(mlp_loss, optax.adam(1e-2), backend=backend, devices=devices, grad_norm=False)
    s1, m1 = with_norm(with_norm.init(params), batch)
    s2, m2 = without(without.init(params), batch)
    want = optax.tree.norm(jax.grad(mlp_loss)(jax.tree.map(jnp.asarray, params), batch))  # one device, whole batch
    np.testing.assert_allclose(float(m1["grad_norm"]), float(want), rtol=1e-5)
    assert "grad_norm" not in m2 and float(m2["loss"]) == float(m1["loss"])
    for a, b in zip(jax.tree.leaves(jdp.get_params(s1)), jax.tree.leaves(jdp.get_params(s2))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("backend", BACKENDS)
def test_aux_metrics_are_global_means(backend):
    (batch,) = batches(1, 32)
    params = mlp_params()
    step = jdp.make_train_step(mlp_loss_acc, optax.sgd(0.1), backend=backend, devices=jax.devices()[:4],
                               has_aux=True)
    _, metrics = step(step.init(params), batch)
    logits = np.asarray(mlp_logits(params, batch["x"]))
    np.testing.assert_allclose(metrics["aux"]["accuracy"], np.mean(logits.argmax(-1) == batch["y"]), rtol=1e-6)
    np.testing.assert_allclose(metrics["loss"], mlp_loss(params, batch), rtol=1e-6)


def _keys_seen(backend, n, seed, steps=2):
    """Run a loss that leaks its key through aux; returns per-step, per-device key data."""
    seen = []

    def loss(params, batch, rng):
        # A per-device value; aux is averaged (and scalar), so report it through one entry per device.
        u = jax.random.uniform(rng)
        return (params["w"] ** 2).sum() * 0.0, {f"u{d}": jnp.where(batch["i"][0] == d, u * n, 0.0) for d in range(n)}

    step = jdp.make_train_step(loss, optax.sgd(0.1), backend=backend, devices=jax.devices()[:n],
                               has_aux=True, needs_rng=True)
    state = step.init({"w": np.ones(3, np.float32)}, seed=seed)
    for _ in range(steps):
        state, m = step(state, {"i": np.arange(n, dtype=np.int32)})
        seen.append(np.array([m["aux"][f"u{d}"] for d in range(n)]))
    return np.stack(seen)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rng_differs_per_device_and_step_and_is_reproducible(backend):
    u = _keys_seen(backend, 4, seed=0)
    assert len(np.unique(u.round(7))) == u.size  # every (step, device) draw differs
    np.testing.assert_array_equal(u, _keys_seen(backend, 4, seed=0))
    assert not np.allclose(u, _keys_seen(backend, 4, seed=1))


def test_rng_is_the_same_on_both_backends():
    np.testing.assert_allclose(_keys_seen("shard_map", 4, seed=3), _keys_seen("pmap", 4, seed=3), rtol=1e-6)


def test_device_key_is_a_function_of_seed_step_and_device():
    base = jax.random.key_data(jax.random.key(5))
    want = jax.random.uniform(jax.random.fold_in(jax.random.fold_in(base, 7), 2))
    mesh = jdp.make_mesh(jax.devices()[:4])
    got = jax.shard_map(lambda: jax.random.uniform(jdp.core.state.device_key(base, jnp.int32(7)))[None],
                        mesh=mesh, in_specs=(), out_specs=jax.sharding.PartitionSpec(jdp.DATA_AXIS))()
    np.testing.assert_allclose(np.asarray(got)[2], want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_placed_batches_pass_through(backend):
    """A batch from step.shard_batch is used as is (pmap once reshaped it a second time)."""
    (batch,) = batches(1, 16)
    ref = jdp.make_train_step(mlp_loss, optax.sgd(0.1), backend=backend, devices=jax.devices()[:4])
    ref_state, ref_m = ref(ref.init(mlp_params()), batch)
    step = jdp.make_train_step(mlp_loss, optax.sgd(0.1), backend=backend, devices=jax.devices()[:4])
    placed = step.shard_batch(batch)
    assert step.shard_batch(placed) is placed
    state, m = step(step.init(mlp_params()), placed)
    np.testing.assert_array_equal(jdp.get_params(state)["l0"]["w"], jdp.get_params(ref_state)["l0"]["w"])
    assert step.trace_count == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_pipeline_batches_split_contiguously_whatever_the_device_count(backend):
    """The data pipeline's global batch does not depend on the device count: 1, 2, 4 or 8 devices
    each get a contiguous block of it, and together they hold exactly that batch."""
    import jdp.data

    x = np.arange(40 * 3, dtype=np.float32).reshape(40, 3)
    global_batch = next(jdp.data.make_batches({"x": x}, 16, seed=2, prefetch=0))
    for n in (1, 2, 4, 8):
        step = jdp.make_train_step(lambda p, b: (p["w"] * b["x"]).mean(), optax.sgd(0.1), backend=backend,
                                   devices=jax.devices()[:n])
        placed = step.shard_batch(global_batch)["x"]
        shards = sorted(placed.addressable_shards, key=lambda s: s.device.id)
        blocks = [np.asarray(s.data).reshape(-1, 3) for s in shards]
        assert all(len(b) == 16 // n for b in blocks)
        np.testing.assert_array_equal(np.concatenate(blocks), global_batch["x"])
