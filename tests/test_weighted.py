"""Token-weighted losses (`jdp.Weighted`): N devices and M micro-batches equal one device on the
global batch per TOKEN, when the real-token counts differ between rows, devices and micro-batches.

The reference divides the sum of every real token's loss by the count of real tokens of the whole
global batch (M·N·b rows). Dividing on each device by its own count (Flax's pmap lm1b example), or
on each micro-batch (equal-weight accumulation), differs from it; these tests check that those
mistakes are visible at the tolerance used, so the exact path is really tested.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import max_abs_diff

import jdp

V, D, L = 16, 8, 8  # vocabulary, width, tokens per row
N, B, STEPS = 4, 2, 3  # devices, rows per device and call, optimizer steps


def token_params(seed=0):
    rng = np.random.default_rng(seed)
    return {"emb": rng.normal(0, 1, (V, D)).astype(np.float32),
            "out": rng.normal(0, 1 / np.sqrt(D), (D, V)).astype(np.float32)}


def per_token(params, batch):
    """(b, L) cross-entropy and correctness of next-token prediction."""
    logits = (jnp.tanh(params["emb"][batch["x"]]) @ params["out"]).astype(jnp.float32)  # f32 softmax under bf16
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return nll, (logits.argmax(-1) == batch["y"]).astype(jnp.float32)


def weighted_loss(params, batch):
    """The exact form: sums over this device's real tokens, and their count."""
    nll, correct = per_token(params, batch)
    w = batch["weights"]
    aux = {"accuracy": jdp.Weighted(jnp.sum(w * correct), jnp.sum(w)),
           "plain_accuracy": jnp.sum(w * correct) / jnp.sum(w)}  # a plain mean: weighted by the loss's weight
    return jdp.Weighted(jnp.sum(w * nll), jnp.sum(w)), aux


def own_count_loss(params, batch):
    """The natural port of Flax's lm1b: each device (and micro-batch) divides by its own count."""
    nll, correct = per_token(params, batch)
    w = batch["weights"]
    return jnp.sum(w * nll) / jnp.sum(w), {"accuracy": jnp.sum(w * correct) / jnp.sum(w)}


PADDED = {  # rows of each step's global batch (M = 2 micro-batches of N·B rows) that are all padding
    "first": slice(0, N * B),  # the first micro-batch: every device's weight is 0 on the step's first call
    "second": slice(N * B, 2 * N * B),
    "one_device": slice(0, B),  # with M = 1, the first device's rows: its weight is 0, the step's is not
}


def token_batches(rows, steps=STEPS, seed=3, padded=None):
    """Packed rows with 1..L real tokens each (counts differ per row, device and micro-batch); the
    rows PADDED[padded] have no real token."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        lengths = rng.integers(1, L + 1, rows)
        weights = (np.arange(L)[None, :] < lengths[:, None]).astype(np.float32)
        if padded is not None:
            weights[PADDED[padded]] = 0.0
        x = rng.integers(0, V, (rows, L)).astype(np.int32)
        y = rng.integers(0, V, (rows, L)).astype(np.int32)
        out.append({"x": x, "y": y, "weights": weights})
    return out


def global_mean(params, batch):
    nll, _ = per_token(params, batch)
    return jnp.sum(batch["weights"] * nll) / jnp.sum(batch["weights"])


@functools.lru_cache(maxsize=None)
def reference(m, lr_scale=1.0, opt="adam", padded=None):
    """One device, plain JAX, the whole global batch of m·N·B rows per step: params, losses, accuracies."""
    tx = optax.adam(1e-2) if opt == "adam" else optax.sgd(0.5 * lr_scale)
    params = jax.device_put(token_params(), jax.devices()[0])
    state = tx.init(params)
    losses, accs = [], []
    for batch in token_batches(m * N * B, padded=padded):
        loss, grads = jax.value_and_grad(global_mean)(params, batch)
        _, correct = per_token(params, batch)
        accs.append(float(jnp.sum(batch["weights"] * correct) / jnp.sum(batch["weights"])))
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(loss))
    return jax.device_get(params), losses, accs


def run(loss_fn, m=1, opt="adam", padded=None, **options):
    tx = optax.adam(1e-2) if opt == "adam" else optax.sgd(0.5)
    step = jdp.make_train_step(loss_fn, tx, devices=jax.devices()[:N], has_aux=True, accum_steps=m, **options)
    state = step.init(token_params())
    history = []
    for batch in token_batches(m * N * B, padded=padded):
        for micro in step.micro_batches(batch):
            state, metrics = step(state, micro)
        history.append(jax.device_get(metrics))
    return jdp.get_params(state), history


MODES = {
    "shard_map": dict(),
    "pmap": dict(backend="pmap"),
    "every": dict(m=2),
    "last": dict(m=2, accum_sync="last"),
    "pmap-every": dict(m=2, backend="pmap"),
    "zero1-every": dict(m=2, shard_optimizer_state=True),
    "fsdp-last": dict(m=2, accum_sync="last", shard_params=True),
    "skip-every": dict(m=2, skip_nonfinite=True),
}


@pytest.mark.parametrize("mode", MODES)
def test_weighted_loss_equals_one_device_per_token(mode):
    options = dict(MODES[mode])
    m = options.pop("m", 1)
    params, history = run(weighted_loss, m, **options)
    want, losses, accs = reference(m)
    assert max_abs_diff(params, want) <= 2e-6
    np.testing.assert_allclose([h["loss"] for h in history], losses, rtol=2e-6)
    np.testing.assert_allclose([h["aux"]["accuracy"] for h in history], accs, rtol=2e-6)
    np.testing.assert_allclose([h["aux"]["plain_accuracy"] for h in history], accs, rtol=2e-6)
    tokens = [b["weights"].sum() for b in token_batches(m * N * B)]
    np.testing.assert_allclose([h["weight"] for h in history], tokens, rtol=1e-6)  # the step's real tokens
    assert len(set(tokens)) > 1


PADDED_MODES = {
    "every": dict(m=2), "last": dict(m=2, accum_sync="last"), "pmap-every": dict(m=2, backend="pmap"),
    "zero1-every": dict(m=2, shard_optimizer_state=True), "fsdp-every": dict(m=2, shard_params=True),
    "fsdp-last": dict(m=2, accum_sync="last", shard_params=True), "skip-every": dict(m=2, skip_nonfinite=True),
}


@pytest.mark.parametrize("padded,mode", [(p, m) for p in ("first", "second") for m in PADDED_MODES]
                         + [("one_device", "shard_map"), ("one_device", "pmap")])
def test_a_call_or_device_of_padding_only_equals_one_device(padded, mode):
    """A micro-batch that is all padding (weight 0 on every device for that call; the step still has
    real tokens), or a device that holds only padding: one device on the whole global batch, params,
    loss and both accuracies (the plain aux is 0/0 on a device of weight 0, which adds nothing)."""
    options = dict(PADDED_MODES.get(mode, MODES.get(mode)))
    m = options.pop("m", 1)
    params, history = run(weighted_loss, m, padded=padded, **options)
    want, losses, accs = reference(m, padded=padded)
    assert max_abs_diff(params, want) <= 2e-6
    np.testing.assert_allclose([h["loss"] for h in history], losses, rtol=2e-6)
    np.testing.assert_allclose([h["aux"]["accuracy"] for h in history], accs, rtol=2e-6)
    np.testing.assert_allclose([h["aux"]["plain_accuracy"] for h in history], accs, rtol=2e-6)
    assert not any(h["skipped"] for h in history)


def test_a_step_of_padding_only_gives_nan_or_is_skipped():
    """The whole step's weight is 0: loss and params NaN ("every" and "last"), skipped under skip_nonfinite."""
    zero = [dict(b, weights=np.zeros_like(b["weights"])) for b in token_batches(2 * N * B, 1)]
    for options in (dict(), dict(accum_sync="last"), dict(skip_nonfinite=True)):
        step = jdp.make_train_step(weighted_loss, optax.adam(1e-2), devices=jax.devices()[:N], has_aux=True,
                                   accum_steps=2, **options)
        state = step.init(token_params())
        for micro in step.micro_batches(zero[0]):
            state, metrics = step(state, micro)
        assert np.isnan(metrics["loss"]) and int(metrics["weight"]) == 0
        params = jdp.get_params(state)
        if options.get("skip_nonfinite"):
            assert bool(metrics["skipped"]) and max_abs_diff(params, token_params()) == 0
        else:
            assert np.isnan(params["emb"]).all()


@pytest.mark.parametrize("m,sync", [(1, "every"), (2, "every")])
def test_dividing_by_each_devices_own_count_is_visibly_wrong(m, sync):
    """The mistakes the weighted form fixes are far above the tolerance of the test above."""
    params, _ = run(own_count_loss, m, accum_sync=sync, audit=False)  # the audit would refuse it
    want, _, _ = reference(m)
    assert max_abs_diff(params, want) > 1e-4


def test_sum_reduction_with_weights_keeps_its_scale():
    """reduction="sum": psum of the sums over the mean weight, N× the mean's gradient; "auto" (lr/N)
    is then exact for SGD, and "none" is the step of N× the learning rate."""
    params, _ = run(weighted_loss, 2, opt="sgd", reduction="sum")
    want, _, _ = reference(2, opt="sgd")
    assert max_abs_diff(params, want) <= 2e-6
    params, _ = run(weighted_loss, 1, opt="sgd", reduction="sum", lr_correction="none")
    want, _, _ = reference(1, lr_scale=N, opt="sgd")
    assert max_abs_diff(params, want) <= 1e-5


def one_bf16_device(loss_fn, m, permute=False):
    """The step on one device in bfloat16 over the whole global batch (rows reordered: its noise floor)."""
    one = jdp.make_train_step(loss_fn, optax.adam(1e-2), devices=jax.devices()[:1], has_aux=True, precision="bf16")
    state = one.init(token_params())
    for batch in token_batches(m * N * B):
        rows = np.random.default_rng(0).permutation(m * N * B) if permute else slice(None)
        state, metrics = one(state, jax.tree.map(lambda a: a[rows], batch))
    return jdp.get_params(state), metrics


def test_bf16_compute_equals_one_bf16_device():
    """bfloat16 compute: N devices and M micro-batches equal the same step on one device, to bf16's
    own rounding (a gradient summed in bf16 rounds differently over other rows: the one-device run
    on reordered rows gives that floor), far below the per-device-count error."""
    params, history = run(weighted_loss, 2, precision="bf16")
    want, metrics = one_bf16_device(weighted_loss, 2)
    floor = max_abs_diff(one_bf16_device(weighted_loss, 2, permute=True)[0], want)
    wrong, _ = run(own_count_loss, 2, precision="bf16", audit=False)
    print(f"bf16: weighted {max_abs_diff(params, want):.1e}, floor {floor:.1e}, own count {max_abs_diff(wrong, want):.1e}")
    assert max_abs_diff(params, want) <= 3 * floor + 2e-6
    assert max_abs_diff(wrong, want) > 10 * max_abs_diff(params, want)
    np.testing.assert_allclose(history[-1]["loss"], metrics["loss"], rtol=1e-3)


def test_mask_key_beside_a_plain_loss_is_refused_unless_named():
    """A batch entry named "mask" changes nothing unless asked: a plain loss beside it is refused."""
    def already_normalised(params, batch):
        nll, _ = per_token(params, batch)
        return jnp.sum(batch["mask"] * nll) / jnp.sum(batch["mask"])

    batch = token_batches(N * B, 1)[0]
    batch = {"x": batch["x"], "y": batch["y"], "mask": batch["weights"]}
    step = jdp.make_train_step(already_normalised, optax.sgd(0.1), devices=jax.devices()[:N])
    with pytest.raises(ValueError, match=r"entry named 'mask' and loss_fn returns a plain mean.*mask_key=None"):
        step(step.init(token_params()), batch)
    # audit=False: divided by each device's own count, this loss is what the first-call audit refuses
    step = jdp.make_train_step(already_normalised, optax.sgd(0.1), devices=jax.devices()[:N], mask_key=None,
                               audit=False)
    _, metrics = step(step.init(token_params()), batch)
    assert "weight" not in metrics  # left as it is: no rescale


def test_weighted_loss_errors_name_the_fix():
    batch = token_batches(N * B, 1)[0]
    tuple_loss = lambda p, b: (global_mean(p, b), {})  # noqa: E731
    step = jdp.make_train_step(tuple_loss, optax.sgd(0.1), devices=jax.devices()[:N])
    with pytest.raises(ValueError, match=r"returned a tuple of 2 values.*needs has_aux=True"):
        step(step.init(token_params()), batch)
    per_row = lambda p, b: jdp.Weighted(jnp.sum(per_token(p, b)[0], -1), b["weights"].sum(-1))  # noqa: E731
    step = jdp.make_train_step(per_row, optax.sgd(0.1), devices=jax.devices()[:N])
    with pytest.raises(ValueError, match=r"jdp.Weighted with total of shape \(2,\); both fields must be scalars"):
        step(step.init(token_params()), batch)


def test_a_batch_that_still_carries_the_device_axis_is_named():
    """flax.training.common_utils.shard's (devices, b, ...) batch, passed to a jdp step."""
    def loss(params, batch):
        assert batch["x"].ndim == 2, "the model takes (batch, length) tokens"
        return global_mean(params, batch)

    batch = jax.tree.map(lambda a: a.reshape(N, -1, *a.shape[1:]), token_batches(N * B, 1)[0])
    step = jdp.make_train_step(loss, optax.sgd(0.1), devices=jax.devices()[:N])
    with pytest.raises(ValueError, match=r"AssertionError: the model takes.*common_utils.shard.*pass it unsharded"):
        step(step.init(token_params()), batch)


def nnx_token_model(rate):
    """The same token model as an nnx.Module, with dropout."""
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self):
            p = token_params()
            self.emb, self.out = nnx.Param(jnp.asarray(p["emb"])), nnx.Param(jnp.asarray(p["out"]))
            self.drop = nnx.Dropout(rate, rngs=nnx.Rngs(dropout=0))

        def __call__(self, x):
            return self.drop(jnp.tanh(self.emb[...][x])) @ self.out[...]

    return Model()


def nnx_loss(model, batch):
    nll = optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"])
    return jdp.Weighted(jnp.sum(batch["weights"] * nll), jnp.sum(batch["weights"]))


@pytest.mark.parametrize("m,sync", [(2, "every"), (2, "last")])
def test_nnx_weighted_loss_equals_one_device(m, sync):
    step = jdp.nnx.make_train_step(nnx_token_model(0.0), nnx_loss, optax.adam(1e-2), devices=jax.devices()[:N],
                                   accum_steps=m, accum_sync=sync)
    state = step.init()
    for batch in token_batches(m * N * B):
        for micro in step.micro_batches(batch):
            state, metrics = step(state, micro)
    got = jdp.get_params(state)
    want, losses, _ = reference(m)
    assert max_abs_diff({"emb": got["emb"], "out": got["out"]}, want) <= 2e-6
    np.testing.assert_allclose(metrics["loss"], losses[-1], rtol=2e-6)


def test_evaluate_takes_per_token_weights_and_two_argument_metric_fns():
    """Per-token values with (b, L) weights, a padded last batch: the mean over every real token."""
    data = token_batches(13, 1, seed=9)[0]  # 13 rows: the last batch of 8 on 4 devices is padded
    params = token_params()
    step = jdp.make_train_step(global_mean, optax.sgd(0.1), devices=jax.devices()[:N])
    state = step.init(params)

    def per_token_metrics(params, batch):  # no model state: (params, batch), as a Linen TrainState has
        nll, correct = per_token(params, batch)
        w = batch["weights"]
        return {"loss": jdp.Weighted(w * nll, w), "accuracy": jdp.Weighted(w * correct, w)}

    got = step.evaluate(state, per_token_metrics, data, batch_size=8)
    nll, correct = per_token(params, data)
    w = data["weights"]
    np.testing.assert_allclose(got["loss"], float(jnp.sum(w * nll) / w.sum()), rtol=1e-6)
    np.testing.assert_allclose(got["accuracy"], float(jnp.sum(w * correct) / w.sum()), rtol=1e-6)
    per_row = float(jnp.mean(jnp.sum(w * nll, -1) / w.sum(-1)))  # a mean of row means differs: visible
    assert abs(got["loss"] - per_row) > 1e-3


def test_assert_data_parallel_exact_takes_weighted_losses_and_names_own_counts():
    """jdp.testing's check: a weighted loss passes in every mode with varying token counts; the
    same loss divided by each device's own count fails, naming that as the cause."""
    from jdp.testing import NotExactError, assert_data_parallel_exact

    data = token_batches(2 * N * B, steps=2)
    report = assert_data_parallel_exact(weighted_loss, optax.adam(1e-2), token_params(), data,
                                        devices=jax.devices()[:N], accum_steps=2, has_aux=True)
    assert report.ok
    with pytest.raises(NotExactError, match=r"not a mean over examples.*divides by each shard's own count.*"
                                            r"jdp.Weighted"):
        assert_data_parallel_exact(own_count_loss, optax.adam(1e-2), token_params(), data,
                                   devices=jax.devices()[:N], backends="shard_map", accum_steps=2, has_aux=True)


@pytest.mark.parametrize("m,sync,per_update", [(1, "every", 1), (2, "every", 2), (2, "last", 1)])
def test_the_weight_travels_in_the_gradients_all_reduce(m, sync, per_update):
    """No extra collective for the weight: one all-reduce per call carries gradient, loss, aux and
    weight; with "last", one per optimizer step."""
    step = jdp.make_train_step(weighted_loss, optax.adam(1e-2), devices=jax.devices()[:N], has_aux=True,
                               accum_steps=m, accum_sync=sync)
    state = step.init(token_params())
    rep = jdp.comm_report(step, state, token_batches(N * B, 1)[0])
    assert [a.carries_gradients for a in rep.allreduces].count(True) == 1
    plain = jdp.make_train_step(own_count_loss, optax.adam(1e-2), devices=jax.devices()[:N], has_aux=True,
                                accum_steps=m, accum_sync=sync)
    assert len(rep.allreduces) == len(jdp.comm_report(plain, plain.init(token_params()),
                                                      token_batches(N * B, 1)[0]).allreduces)
    assert rep.gradient_allreduces_per_update == per_update
    grad_bytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves(token_params()))
    assert grad_bytes <= max(a.bytes for a in rep.allreduces) <= grad_bytes + 64
