"""jdp.linen: a Flax Linen TrainState trained through jdp equals the one-device `apply_gradients` loop.

Every case starts the bridge from a TrainState that has already taken one-device steps (so the
optimizer state and step count must be continued, not restarted), trains 3 optimizer steps on 4
devices, and hands the state back with `to_train_state` for 2 more one-device steps: params,
optimizer state and step count must equal the plain Linen loop's at both points.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training.train_state import TrainState as LinenTrainState

import jdp
import jdp.linen
from helpers import batches, max_abs_diff

DEVICES = 4
PER_DEVICE = 4  # b
STEPS, AFTER = 3, 2  # optimizer steps through the bridge, then one-device steps after to_train_state
TOL = 2e-5
TXS = {"momentum": lambda: optax.sgd(0.1, momentum=0.9), "adam": lambda: optax.adam(1e-2)}


class MLP(nn.Module):
    """(batch, 6) -> (batch, 5) logits."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(5)(jnp.tanh(nn.Dense(8)(x)))


def linen_state(tx) -> LinenTrainState:
    model = MLP()
    params = model.init(jax.random.key(0), jnp.zeros((1, 6)))["params"]
    return LinenTrainState.create(apply_fn=model.apply, params=params, tx=tx)


def loss_for(state: LinenTrainState):
    """The loss as Flax's Linen examples write it, for one device, around `state.apply_fn`."""

    def loss_fn(params, batch):
        logits = state.apply_fn({"params": params}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    return loss_fn


@jax.jit
def linen_step(state: LinenTrainState, batch) -> LinenTrainState:
    """The plain one-device Linen step on the whole global batch."""
    return state.apply_gradients(grads=jax.grad(loss_for(state))(state.params, batch))


def data(num, accum_steps):
    return batches(num, accum_steps * DEVICES * PER_DEVICE, seed=3, sizes=(6, 8, 5))


@pytest.mark.parametrize("backend, tx, accum_steps, accum_sync, warmup", [
    ("shard_map", "momentum", 1, "every", 2),
    ("shard_map", "momentum", 2, "every", 2),
    ("shard_map", "momentum", 2, "last", 2),
    ("shard_map", "adam", 1, "every", 2),
    ("shard_map", "adam", 2, "every", 2),
    ("shard_map", "adam", 2, "last", 1),  # an odd step count: micro_step = count·M is not count mod M
    ("pmap", "adam", 2, "every", 0),  # from TrainState.create itself: step is the int 0
    ("jit", "momentum", 1, "every", 2),  # the global view: the loss sees the whole global batch
    ("jit", "adam", 2, "every", 1),
])
def test_bridge_equals_the_linen_loop_and_hands_back(backend, tx, accum_steps, accum_sync, warmup):
    global_batches = data(warmup + STEPS + AFTER, accum_steps)
    start = linen_state(TXS[tx]())
    for batch in global_batches[:warmup]:
        start = linen_step(start, batch)
    reference = [start]
    for batch in global_batches[warmup:]:
        reference.append(linen_step(reference[-1], batch))
    at_handback, final = reference[STEPS], reference[-1]
    before = jax.device_get(start.params)

    step, state = jdp.linen.make_train_step(start, loss_for(start), backend=backend, accum_steps=accum_steps,
                                            accum_sync=accum_sync, devices=jax.devices()[:DEVICES])
    assert int(step.canonical(state).step) == warmup  # the step count continues
    for batch in global_batches[warmup:warmup + STEPS]:
        for micro in step.micro_batches(batch):
            state, metrics = step(state, micro)
        assert bool(metrics["updated"])
    jdp.check_replicas(state)
    deviation = max_abs_diff(jdp.get_params(state), at_handback.params)
    assert deviation <= TOL, deviation

    back = jdp.linen.to_train_state(start, state)
    assert int(back.step) == warmup + STEPS
    assert isinstance(back.step, int) == isinstance(start.step, int)
    assert jax.tree.structure(back.opt_state) == jax.tree.structure(at_handback.opt_state)
    assert max_abs_diff(back.opt_state, at_handback.opt_state) <= TOL
    for batch in global_batches[warmup + STEPS:]:
        back = linen_step(back, batch)
    assert int(back.step) == int(final.step) == warmup + STEPS + AFTER
    after = max_abs_diff(back.params, final.params)
    assert after <= TOL, after
    assert max_abs_diff(start.params, before) == 0  # the TrainState the bridge started from is intact
    print(f"\n{backend} {tx} accum=({accum_steps}, {accum_sync}): max|dparam| {deviation:.2e} after the bridge, "
          f"{after:.2e} after {AFTER} more one-device steps")


def test_one_sentence_errors():
    start = linen_state(optax.sgd(0.1))
    loss_fn = loss_for(start)
    devices = jax.devices()[:DEVICES]
    with pytest.raises(ValueError, match=r"must be a flax\.training\.train_state\.TrainState"):
        jdp.linen.make_train_step({"params": start.params}, loss_fn, devices=devices)
    with pytest.raises(ValueError, match=r"loss_fn must take \(params, batch\); its signature is \(params\)"):
        jdp.linen.make_train_step(start, lambda params: 0.0, devices=devices)  # the MNIST example's closure
    with pytest.raises(ValueError, match=r"loss_fn must take \(params, batch, rng\)"):
        jdp.linen.make_train_step(start, loss_fn, needs_rng=True, devices=devices)
    with pytest.raises(ValueError, match=r"^loss_fn takes \(params, batch, rng\), one argument more than \(params, "
                                         r"batch\): pass needs_rng=True if the last is a random key"):
        jdp.linen.make_train_step(start, lambda params, batch, rng: 0.0, devices=devices)
    with pytest.raises(ValueError, match=r"needs reduction='mean'"):
        jdp.linen.make_train_step(start, loss_fn, reduction="sum", devices=devices)
    other = linen_state(optax.adam(1e-3))
    with pytest.raises(ValueError, match=r"opt_state is not the state train_state\.tx makes"):
        jdp.linen.make_train_step(other.replace(opt_state=start.opt_state), loss_fn, devices=devices)

    step, state = jdp.linen.make_train_step(start, loss_fn, devices=devices)
    with pytest.raises(ValueError, match=r"must be a flax\.training\.train_state\.TrainState"):
        jdp.linen.to_train_state(state, state)
    with pytest.raises(ValueError, match=r"structure train_state\.tx\.init gives"):
        jdp.linen.to_train_state(other, state)


@pytest.mark.parametrize("accum_sync", ["every", "last"])
def test_to_train_state_refuses_a_partial_optimizer_step(accum_sync):
    start = linen_state(optax.sgd(0.1, momentum=0.9))
    step, state = jdp.linen.make_train_step(start, loss_for(start), accum_steps=2, accum_sync=accum_sync,
                                            devices=jax.devices()[:DEVICES])
    first, second = step.micro_batches(data(1, 2)[0])
    state, _ = step(state, first)
    with pytest.raises(ValueError, match=r"in the middle of an optimizer step"):
        jdp.linen.to_train_state(start, state)
    state, _ = step(state, second)
    assert int(jdp.linen.to_train_state(start, state).step) == 1
    np.testing.assert_array_equal(jax.tree.leaves(jdp.get_params(state))[0],
                                  jax.tree.leaves(jdp.linen.to_train_state(start, state).params)[0])


class BNMLP(nn.Module):
    """(batch, 6) -> (batch, 5), a BatchNorm between the layers (axis_name: where statistics are reduced)."""
    axis_name: str | None = "batch"

    @nn.compact
    def __call__(self, x, train: bool = True):
        h = nn.BatchNorm(use_running_average=not train, momentum=0.5, axis_name=self.axis_name)(nn.Dense(8)(x))
        return nn.Dense(5)(jnp.tanh(h))


class StatsTrainState(LinenTrainState):
    """Flax's ImageNet example's TrainState: batch_stats beside the params."""
    batch_stats: object = None


def bn_state(axis_name="batch", tx=None):
    model = BNMLP(axis_name)
    variables = model.init(jax.random.key(0), jnp.zeros((1, 6)))
    return StatsTrainState.create(apply_fn=model.apply, params=variables["params"], tx=tx or optax.sgd(0.5),
                                  batch_stats=variables["batch_stats"])


def bn_loss(state):
    def loss_fn(params, batch_stats, batch):
        logits, new = state.apply_fn({"params": params, "batch_stats": batch_stats}, batch["x"],
                                     mutable=["batch_stats"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        return loss, new["batch_stats"]
    return loss_fn


def test_batch_stats_field_is_the_model_state_and_comes_back_trained():
    """A TrainState with batch_stats: no extra argument; the explicit form gives the same; the
    trained statistics (not the initial ones) come back, equal to one device's."""
    state, data_ = bn_state(), batches(3, 16, seed=5, sizes=(6, 8, 5))
    step, jstate = jdp.linen.make_train_step(state, bn_loss(state), axis_name="batch", devices=jax.devices()[:4])
    explicit, estate = jdp.linen.make_train_step(state, bn_loss(state), axis_name="batch", has_state=True,
                                                 model_state=state.batch_stats, devices=jax.devices()[:4])
    for batch in data_:
        jstate, _ = step(jstate, batch)
        estate, _ = explicit(estate, batch)
    trained = jdp.linen.to_train_state(state, jstate)
    assert max_abs_diff(trained.batch_stats, state.batch_stats) > 1e-2
    assert max_abs_diff(trained.batch_stats, jdp.linen.to_train_state(state, estate).batch_stats) == 0
    one, one_state = jdp.linen.make_train_step(state, bn_loss(state), axis_name="batch", devices=jax.devices()[:1])
    for batch in data_:
        one_state, _ = one(one_state, batch)
    assert max_abs_diff(trained.batch_stats, jdp.linen.to_train_state(state, one_state).batch_stats) <= 1e-5
    assert max_abs_diff(trained.params, jdp.linen.to_train_state(state, one_state).params) <= 1e-5


def test_assert_data_parallel_exact_checks_a_linen_model_with_batch_stats():
    """Passes for synchronised statistics (axis_name bound on one device in the reference); fails,
    naming batch_stats and params, for per-device statistics accepted with sync_batchnorm=False."""
    from jdp.testing import NotExactError, assert_data_parallel_exact
    data_ = batches(2, 16, seed=7, sizes=(6, 8, 5))
    state = bn_state("batch")
    report = assert_data_parallel_exact(bn_loss(state), optax.sgd(0.5), state.params, data_, devices=jax.devices()[:4],
                                        backends="shard_map", has_state=True, model_state=state.batch_stats,
                                        axis_name="batch")
    assert any(r.name.startswith("model_state") for r in report.rows)
    local = bn_state(None)
    with pytest.raises(NotExactError, match=r"FAIL .*model_state"):
        assert_data_parallel_exact(bn_loss(local), optax.sgd(0.5), local.params, data_, devices=jax.devices()[:4],
                                   backends="shard_map", has_state=True, model_state=local.batch_stats,
                                   sync_batchnorm=False)


def test_batchnorm_mistakes_are_one_sentence():
    state, batch = bn_state(None), batches(1, 16, seed=5, sizes=(6, 8, 5))[0]
    step, jstate = jdp.linen.make_train_step(state, bn_loss(state), devices=jax.devices()[:4])
    with pytest.raises(ValueError, match=r"model_state\['BatchNorm_0'\]\['(mean|var)'\] comes out of loss_fn "
                                         r"different on each device .*sync_batchnorm=False"):
        step(jstate, batch)  # the one-device form of BatchNorm: per-device statistics
    synced = bn_state("batch")
    step, jstate = jdp.linen.make_train_step(synced, bn_loss(synced), devices=jax.devices()[:4])
    with pytest.raises(ValueError, match=r"reduces over the mesh axis 'batch' .* the step binds 'data': pass "
                                         r"axis_name='batch' to make_train_step"):
        step(jstate, batch)  # the model reduces over 'batch', the step binds its default 'data'

    def nested(params, batch_stats, batch):  # the whole mutable dict instead of its batch_stats
        loss, stats = bn_loss(synced)(params, batch_stats, batch)
        return loss, {"batch_stats": stats}
    step, jstate = jdp.linen.make_train_step(synced, nested, axis_name="batch", devices=jax.devices()[:4])
    with pytest.raises(ValueError, match=r"new model state that differs .*wrapped in \{'batch_stats': \.\.\.\}"):
        step(jstate, batch)
    plain = linen_state(optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"has_state=True needs the model state the loss takes: pass model_state="):
        jdp.linen.make_train_step(plain, bn_loss(plain), has_state=True)
    with pytest.raises(ValueError, match="train_state has batch_stats, which a BatchNorm updates on every step"):
        jdp.linen.make_train_step(state, bn_loss(state), has_state=False)
    with pytest.raises(ValueError, match=r"axis_name='data axis' must be a mesh axis name"):
        jdp.make_train_step(loss_for(plain), optax.sgd(0.1), axis_name="data axis")
