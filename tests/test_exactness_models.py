"""assert_data_parallel_exact on every kind of model and loss the docs show: it passes on each as
written, and fails with a NotExactError (its report, no other exception) when the loss is made a
mean of per-device means (it divides by each shard's own count of real examples)."""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import jdp
from jdp.testing import NotExactError, assert_data_parallel_exact

FOUR = jax.devices()[:4]


def data(steps, size, seed=0):
    """Global batches of (12,) inputs, labels of 5 classes and a 0/1 weight per example whose count
    differs between the device shards (so a per-shard mean is not the global one)."""
    rng = np.random.default_rng(seed)
    return [{"x": rng.normal(size=(size, 12)).astype(np.float32), "y": rng.integers(0, 5, size).astype(np.int32),
             "w": (rng.random(size) < 0.6).astype(np.float32)} for _ in range(steps)]


def per_example(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])


def accuracy(kind, logits, batch):
    """A mean over the examples; beside a jdp.Weighted loss, over the same weight (language-models.md)."""
    correct = (logits.argmax(-1) == batch["y"]).astype(jnp.float32)
    return {"accuracy": jnp.sum(batch["w"] * correct) / jnp.sum(batch["w"]) if kind == "weighted" else correct.mean()}


def reduce(kind, planted, losses, w):
    """The loss as `kind` returns it; `planted`: the mean of per-device means of the same kind."""
    if kind == "weighted":
        return jdp.Weighted(jnp.sum(w * losses) / jnp.sum(w), 1.0) if planted else jdp.Weighted(jnp.sum(w * losses),
                                                                                               jnp.sum(w))
    if kind == "mask_key":  # mask_key="mask": sum(mask · l) / b, jdp divides by the real count
        return jnp.sum(w * losses) / (jnp.sum(w) if planted else len(w))
    return jnp.sum(w * losses) / jnp.sum(w) if planted else losses.mean()


def array_params():
    rng = np.random.default_rng(1)
    return {"l0": {"w": (rng.normal(size=(12, 16)) / 4).astype(np.float32), "b": np.zeros(16, np.float32)},
            "l1": {"w": (rng.normal(size=(16, 5)) / 4).astype(np.float32), "b": np.zeros(5, np.float32)}}


def array_case(kind, planted, aux):
    def loss_fn(params, batch):
        logits = jnp.tanh(batch["x"] @ params["l0"]["w"] + params["l0"]["b"]) @ params["l1"]["w"] + params["l1"]["b"]
        loss = reduce(kind, planted, per_example(logits, batch), batch["w"])
        return (loss, accuracy(kind, logits, batch)) if aux else loss

    batches = data(2, 32)
    if kind == "mask_key":
        batches = [{"x": b["x"], "y": b["y"], "mask": b["w"]} for b in batches]
        inner = loss_fn
        loss_fn = lambda params, batch: inner(params, dict(batch, w=batch["mask"]))  # noqa: E731
    return loss_fn, optax.adam(1e-2), array_params(), batches, {"mask_key": "mask"} if kind == "mask_key" else {}


class NnxNet(nnx.Module):  # docs/nnx.md, README: BatchNorm and Dropout, made small
    def __init__(self, *, rngs, batchnorm=True, dropout=False):
        self.linear = nnx.Linear(12, 16, use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(16, rngs=rngs) if batchnorm else None
        self.dropout = nnx.Dropout(0.3, rngs=rngs) if dropout else None
        self.head = nnx.Linear(16, 5, rngs=rngs)

    def __call__(self, x):
        h = self.linear(x)
        h = nnx.relu(self.bn(h) if self.bn is not None else h)
        return self.head(self.dropout(h) if self.dropout is not None else h)


def nnx_case(kind, planted, aux, dropout=False):
    def loss_fn(model, batch):
        logits = model(batch["x"])
        loss = reduce(kind, planted, per_example(logits, batch), batch["w"])
        return (loss, accuracy(kind, logits, batch)) if aux else loss

    model = NnxNet(rngs=nnx.Rngs(0), batchnorm=not dropout, dropout=dropout)
    if dropout:  # testing.md: Dropout cannot match one device; turn it off for the check
        model.dropout.deterministic = True
    return loss_fn, optax.adam(1e-2), model, data(2, 32), {}


class LinenNet(nn.Module):  # docs/linen.md: BatchNorm with axis_name, as Flax's ImageNet example
    batchnorm: bool = True

    @nn.compact
    def __call__(self, x, train: bool = True):
        h = nn.Dense(16, use_bias=not self.batchnorm)(x)
        if self.batchnorm:
            h = nn.BatchNorm(use_running_average=not train, momentum=0.5, axis_name="batch")(h)
        return nn.Dense(5)(jnp.tanh(h))


def linen_case(kind, planted, aux, batchnorm):
    net = LinenNet(batchnorm=batchnorm)
    variables = net.init(jax.random.key(0), jnp.zeros((1, 12)))
    if not batchnorm:  # linen.md's first example: a TrainState and its apply_fn
        ts = train_state.TrainState.create(apply_fn=net.apply, params=variables["params"], tx=optax.sgd(0.3, 0.9))

        def loss_fn(params, batch):
            logits = ts.apply_fn({"params": params}, batch["x"])
            loss = reduce(kind, planted, per_example(logits, batch), batch["w"])
            return (loss, accuracy(kind, logits, batch)) if aux else loss

        return loss_fn, ts.tx, ts.params, data(2, 32), {}

    def loss_fn(params, batch_stats, batch):
        logits, new = net.apply({"params": params, "batch_stats": batch_stats}, batch["x"], mutable=["batch_stats"])
        loss = reduce(kind, planted, per_example(logits, batch), batch["w"])
        return (loss, (accuracy(kind, logits, batch), new["batch_stats"])) if aux else (
            loss, new["batch_stats"])

    return loss_fn, optax.sgd(0.5), variables["params"], data(2, 32), dict(
        has_state=True, model_state=variables["batch_stats"], axis_name="batch")


# id: (make(planted), accum_steps, has_aux)
CASES = {
    "params-mean": (functools.partial(array_case, "mean", aux=True), 1, True),
    "params-mean-accum2": (functools.partial(array_case, "mean", aux=False), 2, False),
    "params-weighted": (functools.partial(array_case, "weighted", aux=False), 1, False),
    "params-weighted-accum2": (functools.partial(array_case, "weighted", aux=True), 2, True),
    "params-mask_key-accum2": (functools.partial(array_case, "mask_key", aux=False), 2, False),
    "nnx-batchnorm-accum2": (functools.partial(nnx_case, "mean", aux=True), 2, True),
    "nnx-weighted": (functools.partial(nnx_case, "weighted", aux=False), 1, False),
    "nnx-weighted-accum2": (functools.partial(nnx_case, "weighted", aux=True), 2, True),
    "nnx-dropout-off": (functools.partial(nnx_case, "mean", aux=False, dropout=True), 1, False),
    "linen-trainstate": (functools.partial(linen_case, "mean", aux=False, batchnorm=False), 1, False),
    "linen-batchnorm-accum2": (functools.partial(linen_case, "mean", aux=True, batchnorm=True), 2, True),
    "linen-batchnorm-weighted": (functools.partial(linen_case, "weighted", aux=False, batchnorm=True), 1, False),
}


# The sentence above the table, where the cause is measured on one device (array params only: a
# model's BatchNorm statistics change with the shards).
CAUSES = {"params-mean": "loss_fn is not a mean over examples: on the first batch",
          "params-mean-accum2": "loss_fn is not a mean over examples: on the first batch",
          "params-weighted": "loss_fn returns jdp.Weighted whose total is not a sum over examples",
          "params-weighted-accum2": "loss_fn returns jdp.Weighted whose total is not a sum over examples",
          "params-mask_key-accum2": "loss_fn is not sum(mask · loss) / b under mask_key='mask'",
          "linen-trainstate": "loss_fn is not a mean over examples: on the first batch"}


def check(case, planted, **options):
    make, accum_steps, has_aux = CASES[case]
    loss_fn, tx, start, batches, extra = make(planted=planted)
    return assert_data_parallel_exact(loss_fn, tx, start, batches, devices=FOUR, accum_steps=accum_steps,
                                      has_aux=has_aux, **extra, **options)


@pytest.mark.parametrize("case", CASES)
def test_the_helper_passes_on_every_documented_model(case):
    report = check(case, planted=False)  # both backends; with accum_steps=2 both accum_sync modes
    assert report.ok and len(report.runs) == (4 if CASES[case][1] == 2 else 2)
    assert any(r.name == "loss" for r in report.rows)


@pytest.mark.parametrize("case", CASES)
def test_a_mean_of_means_fails_with_the_report(case):
    with pytest.raises(NotExactError) as failed:
        check(case, planted=True, backends="shard_map", accum_sync="last")
    assert failed.value.report is not None and failed.value.report.failures
    message = str(failed.value)
    assert "does not take the one-device steps" in message
    first = message.split("\n")[0]
    assert first.startswith(CAUSES[case]) if case in CAUSES else first.startswith("jdp on 4 devices does not take")


def attention_loss(p, batch):
    """One attention layer whose key bias has a true gradient of 0: q · (k + bk) adds the same q · bk
    to every key's logit, which the softmax takes away."""
    x = batch["x"]  # (b, T, d)
    q, k, v = x @ p["wq"], x @ p["wk"] + p["bk"], x @ p["wv"]
    a = jax.nn.softmax(jnp.einsum("btd,bsd->bts", q, k), -1)
    y = jnp.einsum("bts,bsd->btd", a, v).mean(1) @ p["out"]
    return optax.softmax_cross_entropy_with_integer_labels(y, batch["y"]).mean()


def attention_setup():
    rng = np.random.default_rng(0)
    p = {n: (rng.normal(size=(8, 8)) / 3).astype(np.float32) for n in ("wq", "wk", "wv")}
    p["bk"], p["out"] = np.zeros(8, np.float32), (rng.normal(size=(8, 5)) / 3).astype(np.float32)
    return p, [{"x": rng.normal(size=(16, 6, 8)).astype(np.float32), "y": rng.integers(0, 5, 16)} for _ in range(2)]


def test_a_leaf_whose_gradient_is_zero_is_named_with_its_fix():
    params, batches = attention_setup()
    with pytest.raises(NotExactError) as failed:  # Adam turns the bias's rounding into lr-sized steps
        assert_data_parallel_exact(attention_loss, optax.adam(3e-3), params, batches, devices=FOUR,
                                   backends="shard_map")
    assert [r.name for r in failed.value.report.failures] == ["params.bk"]
    first = str(failed.value).split("\n")[0]
    assert first.startswith("params.bk: its gradient is ~0 on the first batch (max |g| ")
    assert "check it with optax.sgd, a larger eps (e.g. optax.adam(lr, eps=1e-3)), or atol_for={'params.bk': 0.01}." \
        in first
    # Each fix the sentence names passes; the other leaves are still held to float32's tolerance.
    report = assert_data_parallel_exact(attention_loss, optax.adam(3e-3), params, batches, devices=FOUR,
                                        backends="shard_map", atol_for={"params.b*": 1e-2})
    assert {r.name: r.tol for r in report.rows}["params.bk"] > 1e-2 > {r.name: r.tol for r in report.rows}["params.wk"]
    assert_data_parallel_exact(attention_loss, optax.adam(3e-3, eps=1e-3), params, batches, devices=FOUR,
                               backends="shard_map")
    with pytest.raises(ValueError, match=r"atol_for names 'params.bq', which matches no leaf; the leaves are "
                                         r"params.bk, params.out"):
        assert_data_parallel_exact(attention_loss, optax.adam(3e-3), params, batches, devices=FOUR,
                                   backends="shard_map", atol_for={"params.bq": 1e-2})
    with pytest.raises(ValueError, match="atol_for must map leaf names"):
        assert_data_parallel_exact(attention_loss, optax.adam(3e-3), params, batches, devices=FOUR,
                                   backends="shard_map", atol_for=1e-2)


def test_a_model_whose_dropout_is_on_is_named():
    loss_fn, tx, model, batches, _ = nnx_case("mean", planted=False, aux=False, dropout=True)
    model.dropout.deterministic = False  # as docs/nnx.md's CNN is built
    with pytest.raises(NotExactError) as failed:
        assert_data_parallel_exact(loss_fn, tx, model, batches, devices=FOUR, backends="shard_map")
    assert str(failed.value).split("\n")[0] == (
        "the model's Dropout (dropout) draws random masks, and each device draws its own, so no data-parallel run "
        "can take one device's steps; turn it off for this check (e.g. model.dropout.deterministic = True, or "
        "nnx.Dropout(rate, deterministic=True)).")
    assert failed.value.report.failures
