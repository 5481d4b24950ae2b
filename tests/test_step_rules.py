"""Traps found by porting Flax tutorials, caught at the step; and what accumulation reports."""
import jax
import numpy as np
import optax
import pytest
from jax import lax

import jdp
from helpers import batches, mlp_logits, mlp_loss, mlp_loss_acc, mlp_params, reference_run


def test_non_scalar_aux_is_refused_with_its_path_and_shape():
    # Flax's tutorials `return loss, logits`: averaged over devices, logits come back as garbage.
    def loss_logits(params, batch):
        logits = mlp_logits(params, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), {"logits": logits}

    step = jdp.make_train_step(loss_logits, optax.sgd(0.1), devices=jax.devices()[:4], has_aux=True)
    with pytest.raises(ValueError, match=r"aux\['logits'\] has shape \(4, 5\); aux must hold scalars"):
        step(step.init(mlp_params()), batches(1, 16)[0])


def test_synchronised_state_with_aux_and_last_sync_runs():
    """A collective inside the loss (BatchNorm with axis_name) once failed with "unbound axis name"
    when jdp traced the loss outside the mesh to size the aux sums; it now matches "every"."""
    def loss_bn(params, state, batch):  # a synchronised running mean, like BatchNorm with axis_name
        mean = lax.pmean(batch["x"].mean(0), jdp.DATA_AXIS)
        loss, aux = mlp_loss_acc(params, batch)
        return loss, (aux, {"mean": 0.9 * state["mean"] + 0.1 * mean})

    out = {}
    for sync in ("every", "last"):
        step = jdp.make_train_step(loss_bn, optax.sgd(0.1), devices=jax.devices()[:4], has_aux=True,
                                   has_state=True, accum_steps=2, accum_sync=sync)
        state = step.init(mlp_params(), {"mean": np.zeros(12, np.float32)})
        for micro in step.micro_batches(batches(1, 16)[0]):
            state, metrics = step(state, micro)
        out[sync] = jdp.get_params(state), jdp.step.get_tree(state, state.model_state), metrics["aux"]["accuracy"]
    for a, b in zip(jax.tree.leaves(out["every"]), jax.tree.leaves(out["last"])):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", ["shard_map", "pmap"])
def test_every_and_last_report_the_whole_step(backend):
    """With M > 1 both modes report loss, aux and grad_norm of the whole global batch on the update
    call (the one-device values at the params before it) and NaN on the calls between."""
    m, data = 3, batches(2, 24, seed=4)
    ref_losses = reference_run(mlp_loss, optax.sgd(0.2), mlp_params(), data)[1]
    logs = {}
    for sync in ("every", "last"):
        step = jdp.make_train_step(mlp_loss_acc, optax.sgd(0.2), backend=backend, devices=jax.devices()[:4],
                                   accum_steps=m, accum_sync=sync, has_aux=True)
        state = step.init(mlp_params())
        log = []
        for batch in data:
            for micro in step.micro_batches(batch):
                state, metrics = step(state, micro)
                log.append(jax.device_get(metrics))
        logs[sync] = log
    for sync, log in logs.items():
        updates = log[m - 1::m]
        np.testing.assert_allclose([x["loss"] for x in updates], ref_losses, rtol=1e-5)
        assert all(np.isnan(x["loss"]) and np.isnan(x["grad_norm"]) and np.isnan(x["aux"]["accuracy"])
                   for i, x in enumerate(log) if i % m != m - 1), sync
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([x[key] for x in logs["every"]], [x[key] for x in logs["last"]], rtol=1e-5)
    first = float(mlp_loss_acc(mlp_params(), data[0])[1]["accuracy"])  # the whole first batch, initial params
    for sync, log in logs.items():
        np.testing.assert_allclose(log[m - 1]["aux"]["accuracy"], first, rtol=1e-6, err_msg=sync)


def test_options_are_one_validated_value():
    with pytest.raises(jdp.core.options.OptionError, match="lr_correction='auto' only applies to reduction='sum'") as e:
        jdp.make_train_step(mlp_loss, optax.sgd(0.1), lr_correction="auto")
    assert e.value.field == "lr_correction"
    step = jdp.make_train_step(mlp_loss, optax.sgd(0.1), reduction="sum", accum_steps=2, devices=jax.devices()[:2])
    assert (step.lr_correction, step.accum_steps, step.accum_sync) == ("auto", 2, "every")
    with pytest.raises(ValueError, match="grad_norm=1 must be True or False"):
        jdp.make_train_step(mlp_loss, optax.sgd(0.1), grad_norm=1)
    # A loss that takes a key the options do not declare: the option that passes it, at the first call.
    keyed = jdp.make_train_step(lambda params, batch, key: mlp_loss(params, batch), optax.sgd(0.1),
                                devices=jax.devices()[:2])
    with pytest.raises(ValueError, match=r"^loss_fn takes \(params, batch, key\), one argument more than \(params, "
                                         r"batch\): pass needs_rng=True if the last is a random key \(jdp then passes a "
                                         r"jax.random key from the seed, the micro-step and the device\), or "
                                         r"has_state=True if it takes the model state before the batch\."):
        keyed(keyed.init(mlp_params()), batches(1, 8)[0])
