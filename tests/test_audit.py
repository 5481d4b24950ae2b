"""The first-step audit (`jdp.core.audit`): a plain loss that divides by each device's own count of
tokens is refused before the first step under the per-device backends; a mean over rows, a weighted
loss, a mask_key loss written as mask_key expects, synchronised BatchNorm and dropout pass, in every
layout (tests/test_audit_cases.py: micro-batches, sums, mask_key, bfloat16, dropout, aux).

The data are packed rows with 1..L real tokens each (`test_weighted.token_batches`): the counts differ
between the rows every device is audited on, so an own-count loss is visible.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from test_weighted import B, N, own_count_loss, per_token, token_batches, token_params, weighted_loss

import jdp
from jdp.core.audit import AuditError
from jdp.core.options import OptionError

BATCH = token_batches(N * B, steps=1)[0]


def mean_loss(params, batch):
    """A mean over rows (each row's mean over its real tokens): commutes with the split."""
    nll, correct = per_token(params, batch)
    w = batch["weights"]
    per_row = jnp.sum(w * nll, axis=1) / jnp.sum(w, axis=1)
    return jnp.mean(per_row), {"accuracy": jnp.mean(jnp.sum(w * correct, axis=1) / jnp.sum(w, axis=1))}


def stateful(own_count: bool):
    """A loss with synchronised batch statistics (model state, as BatchNorm with axis_name='data') and
    dropout (needs_rng): per-token losses over the real tokens, divided per row (a mean over rows) or by
    this device's own count."""

    def loss_fn(params, model_state, batch, rng):
        h = jnp.tanh(params["emb"][batch["x"]])  # (b, L, D)
        w = batch["weights"]
        mean = lax.pmean(jnp.mean(h, (0, 1)), "data")  # the global batch's statistics, as BatchNorm's
        h = (h - mean) * jax.random.bernoulli(rng, 0.7, h.shape) / 0.7
        nll = optax.softmax_cross_entropy_with_integer_labels(h @ params["out"], batch["y"])
        new_state = {"mean": 0.9 * model_state["mean"] + 0.1 * mean}
        if own_count:
            return jnp.sum(w * nll) / jnp.sum(w), new_state
        return jnp.mean(jnp.sum(w * nll, axis=1) / jnp.sum(w, axis=1)), new_state

    return loss_fn


def make(loss_fn, *, has_aux=True, **options):
    step = jdp.make_train_step(loss_fn, optax.sgd(0.5), devices=jax.devices()[:N], has_aux=has_aux, **options)
    return step, step.init(token_params())


LAYOUTS = {"shard_map": {}, "pmap": {"backend": "pmap"}, "fsdp": {"shard_params": True},
           "hybrid": {"shard_params": True, "replicas": 2}}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_loss_divided_by_each_devices_own_count_is_refused_in_one_sentence(layout):
    step, state = make(own_count_loss, **LAYOUTS[layout])
    with pytest.raises(AuditError) as e:
        step(state, BATCH)
    message = str(e.value)
    assert "jdp.Weighted" in message and "backend='jit'" in message and "audit=False" in message
    assert message.count(". ") == 0 and message.endswith(".")  # one sentence
    found = e.value.audit
    assert found.verdict == "refused" and found.rows == 2
    assert abs(found.gathered - found.own) > 1e-3 * abs(found.gathered)  # far above the tolerance (1e-4)
    assert not state.step.is_deleted() and np.all(np.asarray(jax.device_get(state.step)) == 0)  # refused before the step ran


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_mean_over_rows_passes_and_the_step_runs(layout):
    step, state = make(mean_loss, **LAYOUTS[layout])
    found = step.audit(state, BATCH)
    assert found.verdict == "commutes"
    assert abs(found.gathered - found.own) <= 1e-6 * abs(found.gathered)
    state, metrics = step(state, BATCH)
    assert int(jax.device_get(metrics["step"])) == 1


def test_batch_statistics_and_dropout_pass_as_a_mean_and_are_refused_as_an_own_count():
    """Both calls of the audit see the same dropout masks and the same synchronised statistics: a mean
    over rows agrees to rounding, an own-count loss is still seen."""
    model_state = {"mean": jnp.zeros(8, jnp.float32)}
    found = {}
    for own in (False, True):
        step = jdp.make_train_step(stateful(own), optax.sgd(0.5), devices=jax.devices()[:N], has_state=True,
                                   needs_rng=True)
        state = step.init(token_params(), model_state)
        if own:
            with pytest.raises(AuditError) as e:
                step(state, BATCH)
            found[own] = e.value.audit
        else:
            found[own] = step.audit(state, BATCH)
            state, _ = step(state, BATCH)  # the model state is the step's: the audit kept none of it
            assert np.all(np.asarray(jax.device_get(state.model_state["mean"])) != 0)
    assert found[False].verdict == "commutes"
    assert abs(found[False].gathered - found[False].own) <= 1e-6 * abs(found[False].gathered)
    assert found[True].verdict == "refused"


def test_weighted_losses_are_not_audited_and_a_mask_key_loss_is_audited_as_a_mean():
    step, state = make(weighted_loss)
    assert step.audit(state, BATCH).verdict == "weighted"
    step(state, BATCH)

    def masked(params, batch):  # sum(mask · l) / b: jdp divides by the real count
        nll, _ = per_token(params, batch)
        return jnp.sum(batch["mask"] * jnp.mean(nll, axis=1)) / batch["mask"].shape[0]

    batch = {**BATCH, "mask": (np.arange(N * B) % 3 != 0).astype(np.float32)}
    step, state = make(masked, has_aux=False, mask_key="mask")
    assert step.audit(state, batch).verdict == "commutes"  # sum(mask · l) / b is a mean over rows


def test_audit_false_trains_the_own_count_loss_and_step_audit_still_refuses_it():
    step, state = make(own_count_loss, audit=False)
    with pytest.raises(AuditError):
        step.audit(state, BATCH)
    state, metrics = step(state, BATCH)  # the mean of per-device means, as asked
    assert int(jax.device_get(metrics["step"])) == 1
    one = jdp.make_train_step(own_count_loss, optax.sgd(0.5), devices=jax.devices()[:1], has_aux=True)
    assert one.audit(one.init(token_params()), BATCH).verdict == "one device"


def test_the_audit_option_must_be_a_bool():
    with pytest.raises(OptionError, match="audit='no' must be True or False"):
        jdp.make_train_step(mean_loss, optax.sgd(0.1), audit="no")
