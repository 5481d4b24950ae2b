"""Equivalence where a wrong gradient scale changes the result.

Clipping that engages on every step, followed by Adam with a tiny ε, maps g and c·g to the same
update: a mean that forgot its 1/N, or an accumulation that summed its M micro-gradients instead
of averaging them, passes such a test. Here the update sees the scale: heavy-ball momentum is
linear in g, and AdamW has an ε near |g| behind a clip threshold that the first steps exceed and
the later ones do not. Every accumulation mode on both backends, against the one-device reference.
"""
import jax
import numpy as np
import optax
import pytest

import jdp
from helpers import batches, max_abs_diff, mlp_loss, mlp_params, reference_grad_norms, reference_run

DATA = batches(4, 32, seed=11)
CLIP = 0.62  # the reference's gradient norms are 0.663, 0.663, 0.576, 0.568: clipped twice, then not
OPTIMIZERS = {
    "momentum": lambda: optax.sgd(0.1, momentum=0.9),
    # ε = 1e-2 against a root-mean-square gradient of ~0.03: Adam's step depends on the scale.
    "adamw_eps_clip": lambda: optax.chain(optax.clip_by_global_norm(CLIP),
                                          optax.adamw(1e-2, eps=1e-2, weight_decay=0.1)),
}
# (devices, micro-batches M, accum_sync): no accumulation, MultiSteps, and local sums.
CASES = [(4, 1, "every"), (2, 2, "every"), (4, 2, "last"), (2, 4, "last")]
TOL = 2e-5  # float32 rounding; the bugs above move the params by 5.6e-4 (AdamW) and 6e-2 (momentum)


@pytest.fixture(scope="module")
def references():
    return {name: (*reference_run(mlp_loss, make(), mlp_params(), DATA), reference_grad_norms(mlp_loss, make(), mlp_params(), DATA))
            for name, make in OPTIMIZERS.items()}


def test_the_clip_threshold_engages_on_some_steps_only(references):
    norms = references["adamw_eps_clip"][2]
    assert any(n > CLIP for n in norms) and any(n < CLIP for n in norms), norms
    # A gradient twice (or half) as large is on the other side of the threshold on some step.
    assert any(2 * n > CLIP > n for n in norms) and any(n > CLIP > n / 2 for n in norms), norms


@pytest.mark.parametrize("backend", ["shard_map", "pmap"])
@pytest.mark.parametrize("d,m,sync", CASES, ids=[f"d{d}-m{m}-{s}" for d, m, s in CASES])
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_scale_visible_equivalence(references, opt, d, m, sync, backend):
    step = jdp.make_train_step(mlp_loss, OPTIMIZERS[opt](), backend=backend, devices=jax.devices()[:d],
                               accum_steps=m, accum_sync=sync)
    state = step.init(mlp_params())
    losses, norms = [], []
    for global_batch in DATA:
        calls = []
        for micro in step.micro_batches(global_batch):
            state, metrics = step(state, micro)
            calls.append(jax.device_get(metrics))
        if np.isnan(calls[0]["loss"]) or m == 1:  # the update call reports the whole global batch
            losses.append(calls[-1]["loss"])
            norms.append(calls[-1]["grad_norm"])
        else:  # each call reports its micro-batch (equal sizes: their mean is the global mean)
            losses.append(np.mean([c["loss"] for c in calls]))
    ref_params, ref_losses, ref_norms = references[opt]
    assert max_abs_diff(ref_params, mlp_params()) > 100 * TOL  # the run trained
    assert max_abs_diff(jdp.get_params(state), ref_params) <= TOL
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    if norms:  # the reduced gradient itself, at the reference's scale
        np.testing.assert_allclose(norms, ref_norms, rtol=1e-4)
    jdp.check_replicas(state)
