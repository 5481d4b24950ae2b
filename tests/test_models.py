"""The NNX models (CNN with (Sync)BatchNorm, GPT with call-time dropout keys) and a Linen model
trained through make_train_step."""
import pathlib
import re
import subprocess
import sys
from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from benchmarks.common import child_env
import jdp
from jdp.core.state import device_key
from jdp.models import CNN, GPT, apply_with_state, param_count
from helpers import max_abs_diff, reference_run

MOMENTUM = 0.99  # nnx.BatchNorm's default: running = m·running + (1 - m)·batch statistic


def digit_images(n, seed=0):
    """(n, 8, 8, 1) float32 images in [0, 1], like jdp.data.load_digits reshaped."""
    return np.random.default_rng(seed).uniform(0.0, 1.0, (n, 8, 8, 1)).astype(np.float32)


def tokens(batch, t, vocab, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, (batch, t)).astype(np.int32)


def stats(rest):
    """The BatchNorm running averages as a plain {layer: {mean, var}} dict of numpy arrays."""
    return jax.tree.map(np.asarray, nnx.to_pure_dict(rest))


# CNN

def test_cnn_shapes_and_param_count():
    model = CNN(rngs=nnx.Rngs(0))
    # conv 3·3·1·16 + BN 2·16 + conv 3·3·16·32 + BN 2·32 + dense 4·4·32·10 + 10 (convs have no bias)
    assert param_count(model) == 144 + 32 + 4608 + 64 + 5130 == 9978
    x = digit_images(5)
    evaluate = nnx.jit(lambda model, x: model(x, train=False))
    logits = evaluate(model, jnp.asarray(x))
    assert logits.shape == (5, 10) and logits.dtype == jnp.float32
    flat = evaluate(model, jnp.asarray(x.reshape(5, 64)))  # load_digits' (n, 64) layout
    np.testing.assert_allclose(flat, logits, rtol=1e-6, atol=1e-6)
    assert param_count(CNN(3, (4, 8), rngs=nnx.Rngs(0))) == 36 + 8 + 288 + 16 + (128 * 3 + 3)
    with pytest.raises(ValueError, match="8, 8, 1"):
        model(jnp.zeros((2, 28, 28, 1)))


def test_cnn_apply_with_state_returns_new_batch_stats():
    model = CNN(rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    assert {type(v) for v in jax.tree.leaves(rest, is_leaf=lambda v: isinstance(v, nnx.Variable))} == {nnx.BatchStat}
    before = stats(rest)
    x = jnp.asarray(digit_images(32))

    apply = jax.jit(apply_with_state, static_argnums=0, static_argnames="train")
    logits, new_rest = apply(graphdef, params, rest, x, train=True)
    assert logits.shape == (32, 10)
    # The inputs are untouched: merge(copy=True) worked on a private copy.
    jax.tree.map(np.testing.assert_array_equal, stats(rest), before)
    # bn1's new running mean is (1 - m)·(batch mean of conv1's output) from zeros; var from ones.
    conv1 = np.asarray(model.conv1(x))
    after = stats(new_rest)
    np.testing.assert_allclose(after["bn1"]["mean"], (1 - MOMENTUM) * conv1.mean(axis=(0, 1, 2)), rtol=1e-5,
                               atol=1e-7)
    np.testing.assert_allclose(after["bn1"]["var"], MOMENTUM + (1 - MOMENTUM) * conv1.var(axis=(0, 1, 2)),
                               rtol=1e-5)
    assert np.abs(after["bn2"]["mean"]).max() > 1e-4

    # Eval uses the running averages and writes nothing back.
    eval_logits, same_rest = apply(graphdef, params, new_rest, x, train=False)
    jax.tree.map(np.testing.assert_array_equal, stats(same_rest), after)
    assert float(jnp.abs(eval_logits - logits).max()) > 1e-3  # batch vs running statistics differ

    # A second train call keeps averaging from where the first left off.
    _, rest2 = apply(graphdef, params, new_rest, x, train=True)
    np.testing.assert_allclose(stats(rest2)["bn1"]["mean"],
                               (1 - MOMENTUM ** 2) * conv1.mean(axis=(0, 1, 2)), rtol=1e-5, atol=1e-7)


@pytest.fixture(scope="module")
def mesh4():
    return jdp.make_mesh(jax.devices()[:4])


def sharded_bn_stats(sync, mesh, x):
    """New running stats after one train-mode forward pass on x split over mesh's devices.

    Returns one copy per device: leaves of shape (N, C).
    """
    graphdef, params, rest = nnx.split(CNN(sync_batchnorm=sync, rngs=nnx.Rngs(0)), nnx.Param, ...)

    def per_device(params, rest, x):
        _, new_rest = apply_with_state(graphdef, params, rest, x, train=True)
        return jax.tree.map(lambda v: v[None], new_rest)

    f = jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P(), P(jdp.DATA_AXIS)), out_specs=P(jdp.DATA_AXIS),
                      check_vma=False)
    return stats(jax.jit(f)(params, rest, x))


def single_device_bn_stats(x):
    graphdef, params, rest = nnx.split(CNN(rngs=nnx.Rngs(0)), nnx.Param, ...)
    _, new_rest = jax.jit(partial(apply_with_state, graphdef, train=True))(params, rest, x)
    return stats(new_rest)


def test_sync_batchnorm_matches_one_device_on_the_global_batch(mesh4):
    x = digit_images(32, seed=3)
    x[16:] *= 3.0  # devices 2 and 3 see brighter images: per-shard statistics differ clearly
    reference = single_device_bn_stats(jnp.asarray(x))
    synced = sharded_bn_stats(True, mesh4, x)
    local = sharded_bn_stats(False, mesh4, x)
    for layer in ("bn1", "bn2"):
        for name, init in (("mean", 0.0), ("var", 1.0)):
            for d in range(4):
                np.testing.assert_allclose(synced[layer][name][d], reference[layer][name], rtol=1e-5, atol=1e-7)
                # Plain BatchNorm: each device's batch statistic (recovered from one update of the
                # running average) is its own 8 images', at least 3% off the global batch's.
                own, glob = ((s - MOMENTUM * init) / (1 - MOMENTUM) for s in (local[layer][name][d],
                                                                           reference[layer][name]))
                assert np.abs(own - glob).max() > 0.03 * np.abs(glob).max(), (layer, name, d)


def test_sync_batchnorm_stats_are_device_invariant_under_check_vma(mesh4):
    """With check_vma=True (as jdp's step uses), synced stats type-check as replicated P() outputs."""
    graphdef, params, rest = nnx.split(CNN(sync_batchnorm=True, rngs=nnx.Rngs(0)), nnx.Param, ...)
    x = digit_images(32, seed=4)

    def per_device(params, rest, x):
        return apply_with_state(graphdef, params, rest, x, train=True)[1]

    f = jax.shard_map(per_device, mesh=mesh4, in_specs=(P(), P(), P(jdp.DATA_AXIS)), out_specs=P(), check_vma=True)
    jax.tree.map(partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-7), stats(jax.jit(f)(params, rest, x)),
                 single_device_bn_stats(jnp.asarray(x)))


# GPT

VOCAB, CONTEXT = 80, 64


@pytest.fixture(scope="module")
def gpt():
    model = GPT(VOCAB, CONTEXT, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    run = jax.jit(lambda params, tok, key: nnx.merge(graphdef, params, rest, copy=True)(
        tok, train=True, rngs=nnx.Rngs(dropout=key)))
    run_eval = jax.jit(lambda params, tok: nnx.merge(graphdef, params, rest, copy=True)(tok, train=False))
    return model, params, rest, run, run_eval


def test_gpt_param_count_and_no_rng_state(gpt):
    model, _, rest, _, _ = gpt
    d = 64
    block = 2 * (2 * d) + 4 * (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d)  # 2 LN, q/k/v/out, MLP
    assert param_count(model) == VOCAB * d + CONTEXT * d + 2 * block + 2 * d + d * VOCAB == 114432
    # Nothing but params: no RNG keys or counters that merge/split would carry between steps.
    assert jax.tree.leaves(rest) == []
    assert jax.tree.leaves(nnx.state(model, nnx.RngState)) == []


def test_gpt_scanned_is_the_same_model(gpt):
    """scan_layers=True stacks the very blocks an unscanned GPT makes (the same initial params) and
    draws their dropout keys in the same order (the same masks): only how the layers run differs."""
    _, params, _, run, _ = gpt
    scanned = GPT(VOCAB, CONTEXT, scan_layers=True, rngs=nnx.Rngs(0))
    leaves = lambda tree: {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(tree)}  # noqa: E731
    unrolled, stacked = leaves(params), leaves(nnx.state(scanned, nnx.Param))
    assert sum(v.size for v in stacked.values()) == sum(v.size for v in unrolled.values())
    for name, leaf in stacked.items():
        for i in range(len(leaf)) if "['layers']" in name else ():
            np.testing.assert_array_equal(leaf[i], unrolled[name.replace("['layers']", f"['blocks'][{i}]")])
        if "['layers']" not in name:
            np.testing.assert_array_equal(leaf, unrolled[name])
    tok = jnp.asarray(tokens(4, 32, VOCAB))
    want = run(params, tok, jax.random.key(1))  # dropout 0.1: other masks differ by more than 1e-2
    np.testing.assert_allclose(scanned(tok, train=True, rngs=nnx.Rngs(dropout=jax.random.key(1))), want,
                               rtol=1e-5, atol=1e-5)


def test_gpt_dropout_key_is_a_call_argument(gpt):
    _, params, _, run, run_eval = gpt
    tok = jnp.asarray(tokens(4, 32, VOCAB))
    a = run(params, tok, jax.random.key(1))
    assert a.shape == (4, 32, VOCAB) and a.dtype == jnp.float32
    np.testing.assert_array_equal(a, run(params, tok, jax.random.key(1)))
    assert float(jnp.abs(a - run(params, tok, jax.random.key(2))).max()) > 1e-2
    # A raw uint32[2] key (what jdp.core.state.device_key returns) works too.
    raw = jax.random.key_data(jax.random.key(1))
    np.testing.assert_array_equal(a, run(params, tok, raw))
    # Eval: no dropout, no key, deterministic; differs from any train-mode pass.
    e = run_eval(params, tok)
    np.testing.assert_array_equal(e, run_eval(params, tok))
    assert float(jnp.abs(a - e).max()) > 1e-2


def test_gpt_train_without_key_fails_clearly(gpt):
    model = gpt[0]
    with pytest.raises(ValueError, match="needs a key"):
        model(jnp.zeros((1, 4), jnp.int32), train=True)
    no_dropout = GPT(VOCAB, CONTEXT, dropout=0.0, n_layers=1, rngs=nnx.Rngs(0))
    tok = jnp.asarray(tokens(2, 8, VOCAB))
    np.testing.assert_array_equal(no_dropout(tok, train=True), no_dropout(tok, train=False))
    with pytest.raises(ValueError, match="context"):
        model(jnp.zeros((1, CONTEXT + 1), jnp.int32), train=False)


def test_gpt_is_causal(gpt):
    _, params, _, _, run_eval = gpt
    tok = tokens(2, CONTEXT, VOCAB, seed=1)
    changed = tok.copy()
    changed[:, 40] = (changed[:, 40] + 1) % VOCAB
    a, b = run_eval(params, jnp.asarray(tok)), run_eval(params, jnp.asarray(changed))
    np.testing.assert_array_equal(a[:, :40], b[:, :40])  # the past does not see the future
    assert float(jnp.abs(a[:, 40] - b[:, 40]).max()) > 1e-4  # the changed position itself does


def test_gpt_masks_differ_per_device_under_shard_map(gpt, mesh4):
    """jdp.core.state.device_key gives every device its own mask: same tokens, different outputs per device."""
    _, params, rest, _, _ = gpt
    graphdef = nnx.graphdef(gpt[0])
    tok = np.tile(tokens(1, 16, VOCAB), (4, 1))  # one identical sequence per device
    base = jax.random.key_data(jax.random.key(7))

    def per_device(params, tok):
        key = device_key(base, jnp.int32(0))
        return nnx.merge(graphdef, params, rest, copy=True)(tok, train=True, rngs=nnx.Rngs(dropout=key))

    f = jax.jit(jax.shard_map(per_device, mesh=mesh4, in_specs=(P(), P(jdp.DATA_AXIS)),
                              out_specs=P(jdp.DATA_AXIS), check_vma=False))
    out = np.asarray(f(params, tok))
    np.testing.assert_array_equal(out, np.asarray(f(params, tok)))
    for d in range(1, 4):
        assert np.abs(out[d] - out[0]).max() > 1e-2


# Flax Linen through make_train_step

class LinenMLP(nn.Module):
    """(batch, 12) -> (batch, 5) logits."""

    @nn.compact
    def __call__(self, x):
        x = nn.tanh(nn.Dense(16)(x))
        return nn.Dense(5)(x)


LINEN = LinenMLP()


def linen_loss(params, batch):
    logits = LINEN.apply({"params": params}, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def test_linen_params_train_the_same_on_1_and_4_devices():
    rng = np.random.default_rng(5)
    data = [{"x": rng.normal(size=(16, 12)).astype(np.float32), "y": rng.integers(0, 5, 16).astype(np.int32)}
            for _ in range(3)]
    params = jax.device_get(LINEN.init(jax.random.key(0), data[0]["x"])["params"])
    opt = optax.sgd(0.5)
    results = {}
    for n in (1, 4):
        step = jdp.make_train_step(linen_loss, opt, devices=jax.devices()[:n])
        state = step.init(params)
        for batch in data:
            state, _ = step(state, batch)
        results[n] = jdp.get_params(state)
    reference, _ = reference_run(linen_loss, opt, params, data)
    assert max_abs_diff(results[1], reference) <= 2e-5
    assert max_abs_diff(results[4], results[1]) <= 2e-5
    assert max_abs_diff(results[4], params) > 1e-2  # the steps did move the params


def test_linen_example_reaches_090_test_accuracy():
    """examples/linen_mlp.py, run as a user would (its own 4 fake devices), with warnings as errors."""
    script = pathlib.Path(__file__).resolve().parents[1] / "examples" / "linen_mlp.py"
    env = child_env()
    done = subprocess.run([sys.executable, "-W", "error", str(script)], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "4 devices" in done.stdout
    accuracy = float(re.search(r"test accuracy ([0-9.]+)", done.stdout).group(1))
    assert accuracy > 0.9, done.stdout
