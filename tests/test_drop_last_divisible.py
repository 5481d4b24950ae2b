"""drop_last=False on a dataset the global batch divides: no padding at all, and no extra batch.

An epoch of ceil(n / G) batches is n / G here. One batch more would hold nothing but padding: its
mask sums to 0, the step's rescale by the real-example count divides 0 by 0, and the params turn NaN.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdp
from helpers import batches, max_abs_diff, mlp_logits, mlp_loss, mlp_params, reference_run
from jdp.data import make_batches


def take(it, k):
    return [next(it) for _ in range(k)]


@pytest.mark.parametrize("n,g,per_epoch", [(24, 8, 3), (32, 32, 1), (26, 8, 4)])
def test_every_batch_holds_real_examples(n, g, per_epoch):
    it = make_batches({"id": np.arange(n)}, g, seed=2, drop_last=False, prefetch=0)
    assert it.steps_per_epoch == per_epoch
    for epoch in range(2):
        epoch_batches = take(it, per_epoch)
        assert all(b["mask"].sum() > 0 for b in epoch_batches)  # never an all-padding batch
        assert sum(b["mask"].sum() for b in epoch_batches) == n
        real = np.concatenate([b["id"][b["mask"] == 1.0] for b in epoch_batches])
        np.testing.assert_array_equal(np.sort(real), np.arange(n))  # each example once per epoch
        assert (it.epoch, it.step) == (epoch + 1, 0)
    if n % g == 0:
        assert all(b["mask"].all() for b in epoch_batches)


def masked_loss(params, batch):
    """sum(mask · l) / b: the contract for padded batches."""
    per_example = optax.softmax_cross_entropy_with_integer_labels(mlp_logits(params, batch["x"]), batch["y"])
    return jnp.sum(batch["mask"] * per_example) / per_example.shape[0]


def test_training_across_an_epoch_boundary_stays_finite_and_exact():
    (data,) = batches(1, 32, seed=9)
    it = make_batches(data, 16, seed=4, drop_last=False, prefetch=0)
    steps = take(it, 3)  # epoch 0 has 2 batches; the third is the first of epoch 1
    step = jdp.make_train_step(masked_loss, optax.sgd(0.1), devices=jax.devices()[:4], mask_key="mask")
    state = step.init(mlp_params())
    for batch in steps:
        state, metrics = step(state, batch)
        assert np.isfinite(float(metrics["loss"]))
    params = jdp.get_params(state)
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(params))
    ref, _ = reference_run(mlp_loss, optax.sgd(0.1), mlp_params(), [{"x": b["x"], "y": b["y"]} for b in steps])
    assert max_abs_diff(params, ref) <= 1e-6
