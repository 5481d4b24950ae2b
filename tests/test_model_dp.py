"""Flax models through jdp's step: 4 devices equal 1 device; SyncBatchNorm; dropout keys per device."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jdp
import jdp.data
from helpers import max_abs_diff
from jdp.models import CNN, GPT, MLP, functional

BACKENDS = ["shard_map", "pmap"]


def classifier_loss(fm):
    def loss_fn(params, rest, batch):
        logits, new_rest = fm.apply_with_state(params, rest, batch["x"], train=True)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), new_rest
    return loss_fn


def lm_loss(fm):
    def loss_fn(params, rest, batch, rng):
        logits, new_rest = fm.apply_with_state(params, rest, batch["x"], train=True, rngs=rng)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), new_rest
    return loss_fn


def train(fm, loss_fn, data, n, backend="shard_map", needs_rng=False, **options):
    step = jdp.make_train_step(loss_fn, optax.sgd(0.1), backend=backend, devices=jax.devices()[:n],
                               has_state=True, needs_rng=needs_rng, **options)
    state = step.init(fm.params, fm.rest)
    for batch in data:
        state, _ = step(state, batch)
    return jdp.get_params(state), jdp.step.get_tree(state, state.model_state)


def digits_batches(images, steps=3, size=32):
    x, y, _, _ = jdp.data.load_digits(images=images)
    return [{"x": x[i * size:(i + 1) * size], "y": y[i * size:(i + 1) * size]} for i in range(steps)]


def text_batches(steps=3, size=8, context=16):
    corpus = jdp.data.load_char_corpus()
    windows = jdp.data.char_windows(corpus.train[:5000], context, stride=context).arrays
    return [{"x": windows["x"][i * size:(i + 1) * size], "y": windows["y"][i * size:(i + 1) * size]}
            for i in range(steps)], corpus.vocab_size


@pytest.mark.parametrize("backend", BACKENDS)
def test_mlp(backend):
    fm = functional(MLP([64, 32, 10], rngs=nnx.Rngs(0)))
    data = digits_batches(images=False)
    one, _ = train(fm, classifier_loss(fm), data, 1, backend)
    four, _ = train(fm, classifier_loss(fm), data, 4, backend)
    assert max_abs_diff(one, four) <= 2e-5
    assert max_abs_diff(one, fm.params) > 1e-3


@pytest.mark.parametrize("backend", BACKENDS)
def test_cnn_sync_batchnorm_equals_one_device_and_local_does_not(backend):
    data = digits_batches(images=True)
    single = functional(CNN(rngs=nnx.Rngs(0)))
    synced = functional(CNN(sync_batchnorm=True, rngs=nnx.Rngs(0)))
    one_params, one_stats = train(single, classifier_loss(single), data, 1, backend)
    sync_params, sync_stats = train(synced, classifier_loss(synced), data, 4, backend)
    assert max_abs_diff(one_params, sync_params) <= 2e-5
    assert max_abs_diff(one_stats, sync_stats) <= 2e-5
    # A BatchNorm without the axis name computes per-device statistics: refused unless asked for.
    with pytest.raises(ValueError, match=r"model_state\['bn\d'\]\['(mean|var)'\].* different on each device .*"
                                         r"axis_name='data'.*sync_batchnorm=False"):
        train(single, classifier_loss(single), data, 4, backend)
    local_params, local_stats = train(single, classifier_loss(single), data, 4, backend, sync_batchnorm=False)
    # Per-device batch statistics, as PyTorch without SyncBatchNorm: the running variances (averages
    # of per-device variances) and the params come out measurably different from one device.
    assert max_abs_diff(one_stats, local_stats) > 100 * max(max_abs_diff(one_stats, sync_stats), 1e-7)
    assert max_abs_diff(one_params, local_params) > 100 * max(max_abs_diff(one_params, sync_params), 1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gpt_without_dropout(backend):
    data, vocab = text_batches()
    fm = functional(GPT(vocab, 16, d_model=32, n_heads=2, n_layers=1, dropout=0.0, rngs=nnx.Rngs(0)))
    one, _ = train(fm, lm_loss(fm), data, 1, backend, needs_rng=True)
    four, _ = train(fm, lm_loss(fm), data, 4, backend, needs_rng=True)
    assert max_abs_diff(one, four) <= 2e-5
    assert max_abs_diff(one, fm.params) > 1e-3


def dropout_probe(n, seed, trace_twice=False, backend="shard_map"):
    """Each device's dropout output on identical tokens, for two steps: (steps, devices)."""
    fm = functional(GPT(40, 8, d_model=16, n_heads=2, n_layers=1, dropout=0.5, rngs=nnx.Rngs(0)))

    def loss_fn(params, batch, rng):
        out = fm.apply(params, batch["x"], train=True, rngs=rng)
        # aux is averaged over devices (and scalar): one entry per device carries its value out.
        return 0.0 * out.mean(), {f"probe{d}": jnp.where(batch["device"][0] == d, out.mean() * n, 0.0)
                                  for d in range(n)}

    step = jdp.make_train_step(loss_fn, optax.sgd(0.0), backend=backend, devices=jax.devices()[:n],
                               has_aux=True, needs_rng=True)
    state = step.init(fm.params, seed=seed)
    tokens = np.tile(np.arange(8, dtype=np.int32), (n, 1))  # the same sequence on every device
    if trace_twice:  # a call with other shapes first: the step is compiled twice
        state, _ = step(state, {"x": tokens[:, :4], "device": np.arange(n, dtype=np.int32)})
        state = state.replace(micro_step=jnp.zeros_like(state.micro_step), step=jnp.zeros_like(state.step))
    seen = []
    for _ in range(2):
        state, m = step(state, {"x": tokens, "device": np.arange(n, dtype=np.int32)})
        seen.append(np.array([m["aux"][f"probe{d}"] for d in range(n)]))
    assert step.trace_count == (2 if trace_twice else 1)
    return np.stack(seen)


def test_dropout_masks_differ_per_device_and_step_and_are_reproducible():
    probe = dropout_probe(4, seed=0)
    assert len(np.unique(probe.round(6))) == probe.size  # 2 steps × 4 devices, all different
    np.testing.assert_array_equal(probe, dropout_probe(4, seed=0))
    np.testing.assert_array_equal(probe, dropout_probe(4, seed=0, trace_twice=True))
    np.testing.assert_allclose(probe, dropout_probe(4, seed=0, backend="pmap"), rtol=1e-6)
    assert not np.allclose(probe, dropout_probe(4, seed=1))


def test_params_start_identical_on_every_device():
    fm = functional(CNN(sync_batchnorm=True, rngs=nnx.Rngs(3)))
    step = jdp.make_train_step(classifier_loss(fm), optax.sgd(0.1), devices=jax.devices()[:8], has_state=True)
    state = step.init(fm.params, fm.rest)
    jdp.check_replicas(state)
    assert max_abs_diff(jdp.get_params(state), functional(CNN(sync_batchnorm=True, rngs=nnx.Rngs(3))).params) == 0
