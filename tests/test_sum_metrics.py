"""reduction="sum" sums the gradient only: loss, aux and model state are still global-batch means.

Each lr_correction changes what the summed gradient does to the params, never what the step
reports. The reference is plain JAX on one device, computing the same means over the global batch.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdp
from helpers import batches, max_abs_diff, mlp_logits, mlp_loss_acc, mlp_params

N = 4
LR = 0.1
DATA = batches(2, 32, seed=21)


def loss_with_extras(params, model_state, batch):
    """Mean cross-entropy, accuracy as aux, and a running mean of the inputs as model state."""
    logits = mlp_logits(params, batch["x"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    accuracy = (logits.argmax(-1) == batch["y"]).mean()
    new_state = {"mean": 0.9 * model_state["mean"] + 0.1 * batch["x"].mean(axis=0)}
    return loss, ({"accuracy": accuracy}, new_state)


def reference(lr, data):
    """One device, SGD(lr) on each whole global batch: (loss, accuracy, model state) per step, final params."""
    params, model_state = mlp_params(), {"mean": jnp.zeros(12, jnp.float32)}
    grad = jax.jit(jax.value_and_grad(loss_with_extras, has_aux=True))
    out = []
    for batch in data:
        (loss, (aux, model_state)), grads = grad(params, model_state, batch)
        params = jax.tree.map(lambda p, g: p - lr * g, params, grads)
        out.append((float(loss), float(aux["accuracy"]), np.asarray(model_state["mean"])))
    return out, jax.device_get(params)


# What each correction makes of SGD(LR) on the N× gradient: the mean-reduced SGD of this rate.
EFFECTIVE_LR = {"none": N * LR, "auto": LR, "exact": LR}


@pytest.mark.parametrize("backend", ["shard_map", "pmap"])
@pytest.mark.parametrize("correction", ["none", "auto", "exact"])
def test_sum_reports_means_for_every_correction(correction, backend):
    optimizer = jdp.OptimizerSpec("sgd", lr=LR) if correction == "exact" else optax.sgd(LR)
    step = jdp.make_train_step(loss_with_extras, optimizer, backend=backend, devices=jax.devices()[:N],
                               reduction="sum", lr_correction=correction, has_aux=True, has_state=True,
                               sync_batchnorm=False)  # a per-device running mean, averaged
    state = step.init(mlp_params(), {"mean": np.zeros(12, np.float32)})
    want, ref_params = reference(EFFECTIVE_LR[correction], DATA)
    for batch, (loss, accuracy, running_mean) in zip(DATA, want):
        state, metrics = step(state, batch)
        np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-6)
        np.testing.assert_allclose(metrics["aux"]["accuracy"], accuracy, rtol=1e-6)
        np.testing.assert_allclose(jdp.step.get_tree(state, state.model_state)["mean"], running_mean, rtol=1e-5, atol=1e-7)
    assert all(a > 0.0 for _, a, _ in want)  # a zero accuracy would hide an N× sum
    assert max_abs_diff(jdp.get_params(state), ref_params) <= 2e-6
    jdp.check_replicas(state)


@pytest.mark.parametrize("backend", ["shard_map", "pmap"])
def test_sum_with_local_accumulation_reports_means(backend):
    step = jdp.make_train_step(mlp_loss_acc, optax.sgd(LR), backend=backend, devices=jax.devices()[:N],
                               reduction="sum", lr_correction="auto", has_aux=True, accum_steps=2, accum_sync="last")
    state = step.init(mlp_params(), example_batch=step.micro_batches(DATA[0])[0])
    for micro in step.micro_batches(DATA[0]):
        state, metrics = step(state, micro)
    loss, aux = mlp_loss_acc(mlp_params(), DATA[0])  # the update call reports the whole global batch
    np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-6)
    np.testing.assert_allclose(metrics["aux"]["accuracy"], aux["accuracy"], rtol=1e-6)
