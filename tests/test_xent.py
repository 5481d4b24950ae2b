"""The fused, chunked cross-entropy (`jdp.models.fused_cross_entropy`) equals the plain one.

The definition is `plain_cross_entropy`: the whole float32 logits, then optax's loss. The fused
loss must give the same per-token losses, argmax and gradients (of the hidden states and of the
head, tied or not, float32 or bfloat16 compute), with token weights that differ per row (a token
of weight 0 gets no gradient), a T that the chunk does not divide (the last block is partial),
and on 8 devices it must take the one-device step on the whole global batch. And it must lower
the compiled temporary memory: the point of it.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jdp
from jdp.config import ConfigError, load_config
from jdp.models import GPT, fused_cross_entropy, plain_cross_entropy
from jdp.run.tasks import build_task

B, T, D, V, CHUNK = 3, 10, 16, 37, 4  # 10 positions in blocks of 4: the last block holds 2


def _inputs(classes_axis, seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(k[0], (B, T, D))
    w = 0.5 * jax.random.normal(k[1], (D, V) if classes_axis == 1 else (V, D))
    y = jax.random.randint(k[2], (B, T), 0, V)
    # weights that differ per token, some 0 (masked): a fused loss that ignored them would differ
    g = jax.random.uniform(k[3], (B, T)) * (jnp.arange(T)[None, :] < jnp.array([[T], [7], [3]]))
    return x, w, y, g


def _value_and_grads(fn, x, w, y, g, **kw):
    def loss(x, w):
        nll, predicted = fn(x, w, y, **kw)
        return jnp.sum(g * nll), (nll, predicted)
    return jax.value_and_grad(loss, (0, 1), has_aux=True)(x, w)


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
@pytest.mark.parametrize("classes_axis", [1, 0], ids=["head", "tied"])
def test_fused_equals_plain_in_loss_argmax_and_gradients(classes_axis, dtype):
    x, w, y, g = _inputs(classes_axis)
    kw = dict(classes_axis=classes_axis, dtype=dtype and jnp.bfloat16)
    (loss, (nll, pred)), grads = _value_and_grads(plain_cross_entropy, x, w, y, g, **kw)
    (f_loss, (f_nll, f_pred)), f_grads = _value_and_grads(fused_cross_entropy, x, w, y, g, chunk=CHUNK, **kw)
    # the same logits per row and a float32 log-sum-exp in both: float32 rounding, whatever the compute dtype
    np.testing.assert_allclose(f_nll, nll, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(f_loss, loss, rtol=1e-6)
    np.testing.assert_array_equal(f_pred, pred)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype is None else dict(rtol=1e-2, atol=1e-3)  # bf16 gradients
    for f_gr, gr in zip(f_grads, grads):
        assert f_gr.dtype == gr.dtype == jnp.float32
        np.testing.assert_allclose(f_gr, gr, **tol)
    masked = np.asarray(g) == 0
    assert masked.any() and not np.asarray(f_grads[0])[masked].any()  # a weight-0 token gets no gradient


def test_leading_dims_and_a_chunk_larger_than_t_are_the_same_loss():
    x, w, y, g = _inputs(1, seed=1)
    nll, pred = plain_cross_entropy(x, w, y)
    for xs, ys, chunk in ((x[None], y[None], 3), (x.reshape(B * T, D), y.reshape(B * T), 7), (x, y, 64)):
        f_nll, f_pred = fused_cross_entropy(xs, w, ys, chunk=chunk)
        np.testing.assert_allclose(np.asarray(f_nll).reshape(B, T), nll, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(f_pred).reshape(B, T), pred)


@pytest.mark.parametrize("kwargs, message", [
    (dict(chunk=0), r"chunk=0 must be a positive integer"),
    (dict(chunk=2, classes_axis=2), r"classes_axis=2 with w of shape \(16, 37\)"),
    (dict(chunk=2, labels=jnp.zeros((B, T + 1), jnp.int32)), r"labels of shape \(3, 11\) do not fit"),
    (dict(chunk=2, w=jnp.zeros((D, V), jnp.bfloat16)), r"x is float32 and w is bfloat16: pass dtype="),
])
def test_bad_arguments_are_one_sentence(kwargs, message):
    x, w, y, _ = _inputs(1)
    args = dict(x=x, w=w, labels=y) | kwargs
    with pytest.raises(ValueError, match=message):
        fused_cross_entropy(args.pop("x"), args.pop("w"), args.pop("labels"), **args)


def test_the_compiled_temporary_memory_is_a_fraction_of_the_plain_loss():
    # B·T = 4096 tokens over 8192 classes: the plain loss's float32 logits alone are 128 MiB
    x, w, y = jnp.zeros((4, 1024, 256)), jnp.zeros((256, 8192)), jnp.zeros((4, 1024), jnp.int32)

    def temp_bytes(fn, **kw):
        grad = jax.jit(jax.grad(lambda x, w: jnp.sum(fn(x, w, y, **kw)[0]), (0, 1)))
        return grad.lower(x, w).compile().memory_analysis().temp_size_in_bytes

    plain, fused = temp_bytes(plain_cross_entropy), temp_bytes(fused_cross_entropy, chunk=128)
    assert plain >= 2 * 4096 * 8192 * 4  # the logits and their gradient, whole
    assert fused * 4 < plain, (fused, plain)


def _tiny_lm(params, batch):
    """A tied-head LM: hidden tanh(emb[x]), logits hidden @ emb.T; sums over real tokens (jdp.Weighted)."""
    nll, _ = fused_cross_entropy(jnp.tanh(params["emb"][batch["x"]]), params["emb"], batch["y"], chunk=3,
                                 classes_axis=0)
    return jdp.Weighted(jnp.sum(batch["w"] * nll), jnp.sum(batch["w"]))


def test_eight_devices_take_the_one_device_step_on_the_global_batch():
    rng = np.random.default_rng(0)
    params = {"emb": rng.normal(0, 1, (V, D)).astype(np.float32)}
    lengths = rng.integers(0, 9, 16)  # real tokens per row differ per device; some rows are all padding
    batch = {"x": rng.integers(0, V, (16, 8)).astype(np.int32), "y": rng.integers(0, V, (16, 8)).astype(np.int32),
             "w": (np.arange(8)[None, :] < lengths[:, None]).astype(np.float32)}
    step = jdp.make_train_step(_tiny_lm, optax.sgd(0.5), devices=jax.devices()[:8])
    state, metrics = step(step.init(params), batch)

    def definition(p):  # one device, the whole batch, the plain loss: the mean over every real token
        nll, _ = plain_cross_entropy(jnp.tanh(p["emb"][batch["x"]]), p["emb"], batch["y"], classes_axis=0)
        return jnp.sum(batch["w"] * nll) / jnp.sum(batch["w"])

    loss, grads = jax.value_and_grad(definition)(params)
    np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-6)
    np.testing.assert_allclose(jdp.get_params(state)["emb"], params["emb"] - 0.5 * grads["emb"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tie", [False, True], ids=["head", "tied"])
def test_gpt_token_losses_are_the_losses_of_its_logits(tie):
    model = GPT(V, 8, d_model=16, n_heads=2, n_layers=1, dropout=0.0, tie_embeddings=tie, dtype="bf16",
                rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, V)
    labels = jnp.roll(tokens, -1, axis=1)
    logits = model(tokens, train=False)
    nll, predicted = model.token_losses(tokens, labels, chunk=3, train=False)
    np.testing.assert_allclose(nll, optax.softmax_cross_entropy_with_integer_labels(logits, labels), rtol=1e-6)
    np.testing.assert_array_equal(predicted, logits.argmax(-1))


CHAR_GPT = ["model.name=gpt", "data.name=chars", "model.context=8", "model.d_model=16", "model.n_heads=2",
            "model.n_layers=1", "model.dropout=0.0", "data.batch_size=4"]


def test_model_loss_chunk_gives_the_trainers_loss_accuracy_and_gradients():
    def loss_and_grads(chunk):
        task = build_task(load_config(None, CHAR_GPT + [f"model.loss_chunk={chunk}"]))
        x = np.asarray(task.train.arrays["x"][:4])
        batch = {"x": x, "y": np.asarray(task.train.arrays["y"][:4]), "mask": np.array([1, 1, 0, 1], np.float32)}

        def loss(p):
            weighted, (aux, _) = task.loss_fn(p, task.model_state, batch, None)
            return weighted.total / weighted.weight, aux["accuracy"].total
        (value, correct), grads = jax.value_and_grad(loss, has_aux=True)(task.params)
        return value, correct, grads

    plain, fused = loss_and_grads(0), loss_and_grads(5)
    np.testing.assert_allclose(fused[0], plain[0], rtol=1e-6)
    assert fused[1] == plain[1]
    scale = max(float(np.abs(leaf).max()) for leaf in jax.tree.leaves(plain[2]))
    for f_leaf, leaf in zip(jax.tree.leaves(fused[2]), jax.tree.leaves(plain[2])):
        np.testing.assert_allclose(f_leaf, leaf, rtol=1e-5, atol=1e-6 * scale)  # float32 rounding of the largest


def test_model_loss_chunk_takes_the_fused_loss_in_training_and_evaluation():
    for chunk, fused in ((0, False), (5, True)):
        task = build_task(load_config(None, CHAR_GPT + [f"model.loss_chunk={chunk}"]))
        batch = {"x": np.asarray(task.train.arrays["x"][:2]), "y": np.asarray(task.train.arrays["y"][:2])}
        train = jax.make_jaxpr(lambda p: task.loss_fn(p, task.model_state, batch, None))(task.params)
        evaluate = jax.make_jaxpr(lambda p: task.metric_fn(p, task.model_state, batch))(task.params)
        assert ("custom_vjp_call" in str(train), "custom_vjp_call" in str(evaluate)) == (fused, fused), chunk


def test_loss_chunk_on_another_model_is_refused():
    with pytest.raises(ConfigError, match=r"model.loss_chunk=64 applies to the transformer only and needs "
                                          r"model.name='gpt', got 'mlp'"):
        load_config(None, ["model.loss_chunk=64"])
