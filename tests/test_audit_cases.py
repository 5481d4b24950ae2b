"""The audit's definition under every way the step splits the loss: a loss whose value on a set of rows
is not the mean of its values on equal parts of those rows is refused before step 1, whether the
parts are devices (shard_map, pmap) or micro-batches (accum_steps > 1, under jit or on one device).

Each refused loss is also trained with audit=False and compared with ONE device taking ONE step on
the WHOLE global batch: the refusal is of a run that really is off. Dropout (a plain key, NNX, Linen)
and a bfloat16-returned mean must pass; an aux value that is a count is named, never refused.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from test_weighted import B, N, own_count_loss, per_token, token_batches, token_params

import jdp
import jdp.linen
import jdp.nnx
from jdp.core.audit import AuditError

LR = 0.5
M = 2  # micro-batches of the accumulating cases
WHOLE = token_batches(M * N * B, steps=1)[0]  # one optimizer step's global batch, M·N·b rows
CALLS = [{k: v[i * N * B:(i + 1) * N * B] for k, v in WHOLE.items()} for i in range(M)]


def row_mean_loss(params, batch):
    """A mean over rows (each row's mean over its real tokens)."""
    nll, _ = per_token(params, batch)
    w = batch["weights"]
    return jnp.mean(jnp.sum(w * nll, axis=1) / jnp.sum(w, axis=1))


def sum_loss(params, batch):
    """A sum over rows: looks like a mean when rows are repeated."""
    return jnp.sum(jnp.mean(per_token(params, batch)[0], axis=1))


def fixed_divisor_loss(params, batch):
    """Divided by a constant global count of tokens (Hugging Face's num_items_in_batch)."""
    nll, _ = per_token(params, batch)
    return jnp.sum(batch["weights"] * nll) / 64.0


SPLITS = {"jit_accum": {"backend": "jit", "accum_steps": M}, "one_device_accum": {"devices": 1, "accum_steps": M},
          "shard_map": {}}


def step_for(loss_fn, options, **more):
    options = {"devices": N, **options, **more}
    devices = jax.devices()[:options.pop("devices")]
    step = jdp.make_train_step(loss_fn, optax.sgd(LR), devices=devices, **options)
    return step, step.init(token_params())


def calls_of(options):
    return CALLS if options.get("accum_steps", 1) > 1 else [WHOLE]


def off_by(loss_fn, options, reference=None) -> float:
    """max |Δparam| after one optimizer step trained with audit=False against one device on the whole batch
    (`reference`: the loss as one device writes it, where `loss_fn` names the step's axis)."""
    step, state = step_for(loss_fn, options, audit=False)
    for batch in calls_of(options):
        state, _ = step(state, batch)
    ref = jax.tree.map(lambda p, g: p - LR * g, token_params(), jax.grad(reference or loss_fn)(token_params(), WHOLE))
    return max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(jdp.get_params(state)),
                                                              jax.tree.leaves(ref)))


def own_count(params, batch):
    return own_count_loss(params, batch)[0]


@pytest.mark.parametrize("split", ["jit_accum", "one_device_accum"])
def test_an_own_count_loss_split_into_micro_batches_is_refused_before_step_one(split):
    step, state = step_for(own_count, SPLITS[split])
    with pytest.raises(AuditError) as e:
        step(state, calls_of(SPLITS[split])[0])
    message, found = str(e.value), e.value.audit
    assert found.kind == "own count" and found.where == "micro-batches" and found.parts == M
    assert "per-micro-batch means" in message and "backend='jit'" not in message  # jit would not fix it
    assert "jdp.Weighted" in message and "audit=False" in message and message.count(". ") == 0
    assert np.all(np.asarray(jax.device_get(state.step)) == 0)
    assert off_by(own_count, SPLITS[split]) > 1e-3  # the run the audit refuses really is off


@pytest.mark.parametrize("loss_fn", [sum_loss, fixed_divisor_loss], ids=["sum", "fixed_divisor"])
@pytest.mark.parametrize("split", ["shard_map", "jit_accum"])
def test_a_sum_or_a_fixed_divisor_is_refused_on_devices_and_micro_batches(loss_fn, split):
    options = SPLITS[split]
    step, state = step_for(loss_fn, options)
    with pytest.raises(AuditError) as e:
        step(state, calls_of(options)[0])
    found, parts = e.value.audit, N if split == "shard_map" else M
    assert found.kind == "sum or fixed divisor" and found.parts == parts
    np.testing.assert_allclose(found.ratio, parts, rtol=1e-5)  # exactly P× the parts' mean
    assert f"{parts:.3g}× the mean" in str(e.value) and "num_items_in_batch" in str(e.value)
    assert ("backend='jit'" in str(e.value)) == (split == "shard_map")  # jit fixes it only without accumulation
    assert off_by(loss_fn, options) > 1e-2


def masked_batch():
    return {**WHOLE, "mask": (np.arange(M * N * B) % 3 != 0).astype(np.float32)}


def test_a_mask_key_loss_divided_by_sum_of_the_mask_is_refused_and_names_what_mask_key_expects():
    def by_mask(params, batch):  # the loss people write; mask_key expects sum(mask·l)/b
        l = jnp.mean(per_token(params, batch)[0], axis=1)
        return jnp.sum(batch["mask"] * l) / jnp.sum(batch["mask"])

    step, state = step_for(by_mask, {}, mask_key="mask")
    with pytest.raises(AuditError) as e:
        step(state, masked_batch())
    message = str(e.value)
    assert e.value.audit.kind == "own count" and "a mask_key loss normalised by sum(mask)" in message
    assert "return sum(mask·l)/b" in message and "backend='jit'" not in message


def test_a_mean_returned_in_bfloat16_trains_and_equals_one_device():
    def bf16(params, batch):
        return row_mean_loss(params, batch).astype(jnp.bfloat16)

    step, state = step_for(bf16, {})
    assert step.audit(state, WHOLE).verdict == "commutes"
    state, _ = step(state, WHOLE)
    ref = jax.tree.map(lambda p, g: p - LR * g, token_params(), jax.grad(bf16)(token_params(), WHOLE))
    for a, b in zip(jax.tree.leaves(jdp.get_params(state)), jax.tree.leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_count_in_aux_is_named_once_and_trains(capfd):
    def with_count(params, batch):
        return row_mean_loss(params, batch), {"ntokens": jnp.sum(batch["weights"])}

    step, state = step_for(with_count, {"backend": "jit", "accum_steps": M}, has_aux=True)
    for batch in CALLS:
        state, metrics = step(state, batch)
    err = capfd.readouterr().err
    assert err.count("aux['ntokens'] is not a mean over its rows") == 1 and "jdp.Weighted" in err
    assert int(jax.device_get(metrics["step"])) == 1


def plain_dropout(params, batch, rng):
    h = jnp.tanh(params["emb"][batch["x"]])
    h = h * jax.random.bernoulli(rng, 0.5, h.shape) / 0.5
    nll = optax.softmax_cross_entropy_with_integer_labels(h @ params["out"], batch["y"])
    w = batch["weights"]
    return jnp.mean(jnp.sum(w * nll, axis=1) / jnp.sum(w, axis=1))


@pytest.mark.parametrize("split", ["shard_map", "jit_accum"])
def test_dropout_from_the_key_passes(split):
    step, state = step_for(plain_dropout, SPLITS[split], needs_rng=True)
    found = step.audit(state, calls_of(SPLITS[split])[0])
    assert found.verdict == "commutes", found
    step(state, calls_of(SPLITS[split])[0])


class NnxDropout(nnx.Module):
    def __init__(self, *, rngs):
        self.linear = nnx.Linear(6, 16, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)
        self.head = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        return self.head(self.dropout(nnx.relu(self.linear(x))))


def xy(n, seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.normal(size=(n, 6)).astype(np.float32), "y": rng.integers(0, 3, n).astype(np.int32)}


def test_nnx_dropout_passes():
    def loss_fn(model, batch):
        return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"]).mean()

    step = jdp.nnx.make_train_step(NnxDropout(rngs=nnx.Rngs(0)), loss_fn, optax.sgd(0.1), devices=jax.devices()[:N])
    state = step.init(seed=0)
    assert step.audit(state, xy(16)).verdict == "commutes"
    step(state, xy(16))


class LinenDropout(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        return nn.Dense(3)(nn.Dropout(0.5, deterministic=not train)(nn.relu(nn.Dense(16)(x))))


def test_linen_dropout_passes_with_accumulation():
    from flax.training.train_state import TrainState

    model = LinenDropout()
    params = model.init(jax.random.key(0), jnp.zeros((1, 6)), train=False)["params"]
    train_state = TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1))

    def loss_fn(params, batch, rng):
        logits = model.apply({"params": params}, batch["x"], rngs={"dropout": rng})
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    step, state = jdp.linen.make_train_step(train_state, loss_fn, needs_rng=True, accum_steps=M,
                                            devices=jax.devices()[:N])
    assert step.audit(state, xy(16)).verdict == "commutes"
    step(state, xy(16))


def test_a_loss_exact_per_device_but_normalised_per_micro_batch_is_located_there():
    """Divided by the count of the whole call's tokens (a psum over the devices): right over devices, a
    mean of per-micro-batch means with accumulation; the refusal says where."""
    def call_count(params, batch):
        nll, _ = per_token(params, batch)
        w = batch["weights"]
        return jnp.sum(w * nll) / jax.lax.psum(jnp.sum(w), "data") * N

    options = {"accum_steps": M}
    step, state = step_for(call_count, options)
    with pytest.raises(AuditError) as e:
        step(state, CALLS[0])
    assert e.value.audit.where == "micro-batches" and e.value.audit.parts == N * M
    assert "per-micro-batch means" in str(e.value) and "(4 devices × 2 micro-batches)" in str(e.value)
    assert step_for(call_count, {})[0].audit(step_for(call_count, {})[1], WHOLE).verdict == "commutes"
    assert off_by(call_count, options, reference=own_count) > 1e-3


def test_synchronised_statistics_with_accumulation_audit_the_devices_only():
    """Micro-batches have their own batch statistics in the step too: with a model state that depends
    on the rows only the devices are audited; on one device nothing is left to compare."""
    from test_audit import stateful

    state0 = {"mean": jnp.zeros(8, jnp.float32)}
    for devices, verdict in ((N, "commutes"), (1, "micro-batch statistics")):
        step = jdp.make_train_step(stateful(False), optax.sgd(LR), devices=jax.devices()[:devices], has_state=True,
                                   needs_rng=True, accum_steps=M)
        found = step.audit(step.init(token_params(), state0), CALLS[0])
        assert found.verdict == verdict, found
    assert found.verdict == "micro-batch statistics"
