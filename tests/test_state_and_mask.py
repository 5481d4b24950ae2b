"""Model state carried through the step, and padded batches whose mask keeps means exact."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdp
from helpers import batches, max_abs_diff, mlp_logits, mlp_loss, mlp_params, reference_run

BACKENDS = ["shard_map", "pmap"]


def masked_loss(params, batch):
    """sum(mask · l) / b: the contract for padded batches."""
    logits = mlp_logits(params, batch["x"])
    per_example = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return jnp.sum(batch["mask"] * per_example) / per_example.shape[0]


def padded(batch, real):
    """The batch with rows from `real` on replaced by garbage and masked out."""
    x, y = batch["x"].copy(), batch["y"].copy()
    x[real:] = 1e3
    y[real:] = 0
    mask = (np.arange(len(y)) < real).astype(np.float32)
    return {"x": x, "y": y, "mask": mask}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m,sync", [(1, "every"), (2, "every"), (2, "last")])
def test_padded_batch_equals_its_real_examples(backend, m, sync):
    (full,) = batches(1, 16, seed=4)
    real = 11  # the last 5 rows are padding: two devices see only padding or a partial shard
    ref, ref_losses = reference_run(mlp_loss, optax.sgd(0.1), mlp_params(),
                                    [{"x": full["x"][:real], "y": full["y"][:real]}])
    step = jdp.make_train_step(masked_loss, optax.sgd(0.1), backend=backend, devices=jax.devices()[:4],
                               accum_steps=m, accum_sync=sync, mask_key="mask")
    state = step.init(mlp_params())
    for micro in step.micro_batches(padded(full, real)):
        state, metrics = step(state, micro)
    assert max_abs_diff(jdp.get_params(state), ref) <= 1e-6
    np.testing.assert_allclose(metrics["loss"], ref_losses[0], rtol=1e-6)


def running_mean_loss(params, model_state, batch):
    """A loss with BatchNorm-like state: an exponential running mean of the inputs."""
    new_state = {"mean": 0.9 * model_state["mean"] + 0.1 * batch["x"].mean(axis=0)}
    return mlp_loss(params, batch), new_state


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m,sync", [(1, "every"), (2, "every"), (2, "last")])
def test_model_state_is_carried_and_averaged(backend, m, sync):
    """The state changes on every call (each micro-batch), averaged over devices, in every mode.

    Each device's running mean is of its own shard (per-device state, so sync_batchnorm=False); the
    mean is linear, so their average is the global batch's."""
    data = batches(3, 16, seed=6)
    step = jdp.make_train_step(running_mean_loss, optax.adam(1e-2), backend=backend, devices=jax.devices()[:4],
                               has_state=True, accum_steps=m, accum_sync=sync, sync_batchnorm=False)
    state = step.init(mlp_params(), {"mean": np.zeros(12, np.float32)})
    want = np.zeros(12)
    for batch in data:
        for micro in step.micro_batches(batch):
            state, _ = step(state, micro)
            want = 0.9 * want + 0.1 * micro["x"].mean(axis=0)
    np.testing.assert_allclose(jdp.step.get_tree(state, state.model_state)["mean"], want, rtol=1e-5, atol=1e-7)
    ref, _ = reference_run(mlp_loss, optax.adam(1e-2), mlp_params(), data)
    assert max_abs_diff(jdp.get_params(state), ref) <= 2e-5
    jdp.check_replicas(state)


def test_model_state_contract_is_checked():
    step = jdp.make_train_step(mlp_loss, optax.sgd(0.1))
    with pytest.raises(ValueError, match="model_state was given but the step was made without has_state=True"):
        step.init(mlp_params(), {"mean": np.zeros(12, np.float32)})


@pytest.mark.parametrize("grow", ["nest", "shape", "dtype"])
def test_new_model_state_of_another_structure_is_refused_at_the_first_call(grow):
    """One more nesting level, another shape or another dtype per call would recompile every call on a
    state that grows: refused before the first step, naming both structures."""
    def loss(params, state, batch):
        new = {"mean": 0.9 * state["mean"] + 0.1 * batch["x"].mean(axis=0)}
        new = {"nest": {"inner": new}, "shape": {"mean": jnp.concatenate([new["mean"], new["mean"][:1]])},
               "dtype": {"mean": new["mean"].astype(jnp.float16)}}[grow]
        return mlp_loss(params, batch), new

    step = jdp.make_train_step(loss, optax.sgd(0.1), devices=jax.devices()[:2], has_state=True, sync_batchnorm=False)
    state = step.init(mlp_params(), {"mean": np.zeros(12, np.float32)})
    with pytest.raises(ValueError, match=r"new model state that differs from the one it was given.*: given 1 leaves "
                                         r"\(\['mean'\] \(12,\) float32\), returned 1 leaves"):
        step(state, batches(1, 8)[0])
    assert step.trace_count == 0


def test_a_plain_aux_under_mask_key_is_its_mean_over_the_real_rows():
    """A plain aux under mask_key is read as the loss is, sum(mask · a) / b: the step reports its mean over
    the real rows of the global batch (as one device on those rows alone), not over the padded ones too."""
    (full,) = batches(1, 16, seed=4)
    real = 11

    def loss_and_accuracy(params, batch):
        correct = (jnp.argmax(mlp_logits(params, batch["x"]), -1) == batch["y"]).astype(jnp.float32)
        return masked_loss(params, batch), {"accuracy": jnp.sum(batch["mask"] * correct) / correct.shape[0]}

    step = jdp.make_train_step(loss_and_accuracy, optax.sgd(0.1), devices=jax.devices()[:4], has_aux=True,
                               mask_key="mask")
    _, metrics = step(step.init(mlp_params()), padded(full, real))
    ref = np.mean(np.argmax(np.asarray(mlp_logits(mlp_params(), full["x"][:real])), -1) == full["y"][:real])
    assert 0 < ref < 1  # a value the padded rows' count would change
    np.testing.assert_allclose(metrics["aux"]["accuracy"], ref, rtol=1e-6)
