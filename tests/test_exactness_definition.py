"""assert_data_parallel_exact's reference is the definition (one device, one step, the whole global
batch), whatever the step under test accumulates; and the Linen papercuts found porting nanodo:
an optax.MultiSteps optimizer, Linen dropout named as the cause, boxed params handed back boxed,
a sharding constraint inside the model under shard_map refused in one sentence.

Cheap on purpose (a 3 → 2 linear model, 4 devices): each test is the quick-tier test of a mutant."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state as flax_train_state
from jax.sharding import PartitionSpec as P

import jdp
import jdp.linen
from jdp.testing import NotExactError, assert_data_parallel_exact

FOUR = jax.devices()[:4]
PARAMS = {"w": np.random.default_rng(0).normal(size=(3, 2)).astype(np.float32)}


def batch(seed):
    """16 rows whose real-example mask keeps 1 to 8 of each 8: the micro-batches' counts differ."""
    r = np.random.default_rng(seed)
    mask = np.zeros(16, np.float32)
    mask[:8][: r.integers(1, 4)] = 1
    mask[8:] = 1
    return {"x": r.normal(size=(16, 3)).astype(np.float32), "y": r.normal(size=(16, 2)).astype(np.float32),
            "m": r.permutation(mask[:8]).tolist() + mask[8:].tolist()}


BATCHES = [{k: np.asarray(v, np.float32) for k, v in batch(s).items()} for s in range(2)]


def per_example(p, b):
    return ((b["x"] @ p["w"] - b["y"]) ** 2).sum(-1)


def own_count(p, b):  # divided by the real examples of the batch it is given, as nanodo's loss is
    return (per_example(p, b) * b["m"]).sum() / b["m"].sum()


def weighted(p, b):
    return jdp.Weighted((per_example(p, b) * b["m"]).sum(), b["m"].sum())


def test_accumulating_an_own_count_loss_fails_and_its_weighted_form_passes():
    """Under jit the loss sees whole micro-batches: each divides by its own count, so the step is a mean
    of micro-batch means, not the whole batch's mean. The reference is the whole batch: it fails."""
    with pytest.raises(NotExactError, match=r"2 micro-batches.*micro-batch's own count.*jdp\.Weighted"):
        assert_data_parallel_exact(own_count, optax.sgd(0.5), PARAMS, BATCHES, devices=FOUR, backends="jit",
                                   accum_steps=2)
    report = assert_data_parallel_exact(weighted, optax.sgd(0.5), PARAMS, BATCHES, devices=FOUR, backends="jit",
                                        accum_steps=2)
    assert report.ok


def test_multisteps_is_taken_as_the_step_takes_it():
    """optax.MultiSteps(inner, 2): every 2 batches are one step of inner on both together."""
    mean = lambda p, b: per_example(p, b).mean()  # noqa: E731
    report = assert_data_parallel_exact(mean, optax.MultiSteps(optax.adam(0.1), 2), PARAMS, BATCHES, devices=FOUR,
                                        backends="shard_map")
    assert report.steps == 2 and report.ok
    with pytest.raises(NotExactError, match="not a mean over examples"):
        assert_data_parallel_exact(own_count, optax.MultiSteps(optax.sgd(0.5), 2), PARAMS, BATCHES, devices=FOUR,
                                   backends="jit")
    with pytest.raises(ValueError, match="not a whole number of its steps"):
        assert_data_parallel_exact(mean, optax.MultiSteps(optax.sgd(0.5), 2), PARAMS, BATCHES[:1], devices=FOUR)


class Dropped(nn.Module):
    @nn.compact
    def __call__(self, x, train=True):
        return nn.Dropout(0.5)(nn.Dense(2)(x), deterministic=not train)


def test_linen_dropout_is_named_as_the_cause():
    model = Dropped()
    params = model.init(jax.random.key(0), BATCHES[0]["x"], train=False)["params"]

    def loss(p, b):
        out = model.apply({"params": p}, b["x"], rngs={"dropout": jax.random.key(1)})
        return ((out - b["y"]) ** 2).sum(-1).mean()

    with pytest.raises(NotExactError, match=r"^the loss runs Linen's nn.Dropout \(Dropout_0\) with deterministic"):
        assert_data_parallel_exact(loss, optax.sgd(0.5), params, BATCHES, devices=FOUR, backends="shard_map")


class Boxed(nn.Module):
    constrain: bool = False

    @nn.compact
    def __call__(self, x):
        kernel = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "data"))
        y = nn.Dense(4, kernel_init=kernel)(x)
        if self.constrain:  # an activation constraint, written for jax.jit on a ("data",) mesh
            y = jax.lax.with_sharding_constraint(y, P("data"))
        return y.sum(-1)


def boxed_state(model):
    params = model.init(jax.random.key(0), BATCHES[0]["x"])["params"]
    return flax_train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(0.1))


def test_to_train_state_gives_boxed_params_back_boxed():
    state = boxed_state(Boxed())
    loss = lambda p, b: ((state.apply_fn({"params": p}, b["x"]) - b["y"][:, 0]) ** 2).mean()  # noqa: E731
    step, jstate = jdp.linen.make_train_step(state, loss, backend="jit", devices=FOUR)
    jstate, _ = step(jstate, BATCHES[0])
    back = jdp.linen.to_train_state(state, step.canonical(jstate))
    kernel, mu = back.params["Dense_0"]["kernel"], back.opt_state[0].mu["Dense_0"]["kernel"]
    assert isinstance(kernel, nn.Partitioned) and kernel.names == (None, "data") and isinstance(mu, nn.Partitioned)
    np.testing.assert_array_equal(kernel.value, jdp.get_params(jstate)["Dense_0"]["kernel"])
    assert int(back.step) == 1 and jax.tree.structure(back.opt_state) == jax.tree.structure(state.opt_state)


def test_a_sharding_constraint_in_the_model_is_refused_under_shard_map():
    state = boxed_state(Boxed())  # the same params; its apply constrains the activations, as under jax.jit
    model = Boxed(constrain=True)
    loss = lambda p, b: ((model.apply({"params": p}, b["x"]) - b["y"][:, 0]) ** 2).mean()  # noqa: E731
    step, jstate = jdp.linen.make_train_step(state, loss, backend="shard_map", devices=FOUR, audit=False)
    with pytest.raises(ValueError, match=r"^the model constrains how its values lie.*backend='shard_map'; run it "
                                         r"with backend='jit'"):
        step(jstate, BATCHES[0])
