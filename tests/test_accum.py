"""Gradient accumulation: M micro-batches on D devices equal one device on the M·D·b global batch."""
import jax
import numpy as np
import optax
import pytest

import jdp
from helpers import batches, max_abs_diff, mlp_loss, mlp_loss_acc, mlp_params, reference_run

GLOBAL = 32
DATA = batches(3, GLOBAL, seed=11)
ADAMW_CLIP = lambda: optax.chain(optax.clip_by_global_norm(0.3), optax.adamw(1e-2, weight_decay=0.1))  # noqa: E731


def run_accum(make_opt, d, m, sync, backend, reduction="mean", lr_correction=None, data=DATA):
    step = jdp.make_train_step(mlp_loss, make_opt(), backend=backend, devices=jax.devices()[:d], accum_steps=m,
                               accum_sync=sync, reduction=reduction, lr_correction=lr_correction)
    state = step.init(mlp_params())
    log = []
    for global_batch in data:
        for k, micro in enumerate(step.micro_batches(global_batch)):
            before = jdp.get_params(state)
            state, metrics = step(state, micro)
            metrics = jax.device_get(metrics)
            log.append(metrics)
            assert bool(metrics["updated"]) == (k == m - 1)
            if k < m - 1:  # the first M-1 calls leave the params exactly as they were
                assert max_abs_diff(before, jdp.get_params(state)) == 0.0
    return step, state, log


@pytest.fixture(scope="module")
def adamw_reference():
    return reference_run(mlp_loss, ADAMW_CLIP(), mlp_params(), DATA)


@pytest.mark.parametrize("backend", ["shard_map", "pmap"])
@pytest.mark.parametrize("d", [1, 2, 4])
@pytest.mark.parametrize("m,sync", [(1, "every"), (2, "every"), (4, "every"), (2, "last"), (4, "last")])
def test_equivalence_grid_adamw_clip(adamw_reference, d, m, sync, backend):
    step, state, log = run_accum(ADAMW_CLIP, d, m, sync, backend)
    ref_params, ref_losses = adamw_reference
    assert max_abs_diff(jdp.get_params(state), ref_params) <= 2e-5
    assert step.trace_count == 1
    assert [int(x["step"]) for x in log] == [(i + 1) // m for i in range(len(DATA) * m)]
    assert [int(x["micro_step"]) for x in log] == list(range(1, len(DATA) * m + 1))
    if sync == "last":  # the loss of an update call is the mean over the whole global batch
        np.testing.assert_allclose([x["loss"] for x in log[m - 1::m]], ref_losses, rtol=1e-5)
        assert all(np.isnan(x["loss"]) for i, x in enumerate(log) if i % m != m - 1)
    jdp.check_replicas(state)


@pytest.mark.parametrize("backend", ["shard_map", "pmap"])
@pytest.mark.parametrize("sync", ["every", "last"])
def test_sgd_with_schedule_counts_optimizer_steps(backend, sync):
    # The LR rises with the optimizer step: a schedule that counted micro-steps would diverge.
    make = lambda: optax.sgd(lambda count: 0.05 * (count + 1))  # noqa: E731
    ref_params, _ = reference_run(mlp_loss, make(), mlp_params(), DATA)
    _, state, _ = run_accum(make, 4, 4, sync, backend)
    assert max_abs_diff(jdp.get_params(state), ref_params) <= 2e-5


@pytest.mark.parametrize("backend", ["shard_map", "pmap"])
@pytest.mark.parametrize("sync", ["every", "last"])
def test_sum_reduction_with_its_corrections(backend, sync):
    ref_sgd, _ = reference_run(mlp_loss, optax.sgd(0.1), mlp_params(), DATA)
    _, state, _ = run_accum(lambda: optax.sgd(0.1), 4, 2, sync, backend, "sum", "auto")
    assert max_abs_diff(jdp.get_params(state), ref_sgd) <= 2e-5
    spec = jdp.OptimizerSpec("adamw", lr=1e-2, weight_decay=0.1, clip_norm=0.3)
    ref_adamw, _ = reference_run(mlp_loss, spec.build(), mlp_params(), DATA)
    _, state, _ = run_accum(lambda: spec, 4, 2, sync, backend, "sum", "exact")
    assert max_abs_diff(jdp.get_params(state), ref_adamw) <= 2e-5


@pytest.mark.parametrize("backend", ["shard_map", "pmap"])
def test_local_accumulator_is_per_device_state(backend):
    step = jdp.make_train_step(mlp_loss_acc, optax.sgd(0.1), backend=backend, devices=jax.devices()[:4],
                               accum_steps=3, accum_sync="last", has_aux=True)
    micro = step.micro_batches(batches(1, 48, seed=5)[0])
    state = step.init(mlp_params())  # the first call sizes the aux sums: no example batch needed
    assert state.accum.aux is None
    state, m = step(state, micro[0])
    acc = jax.tree.map(np.asarray, jax.device_get(state.accum))
    assert acc.grads["l0"]["w"].shape == (4, 12, 16)
    assert not np.allclose(acc.grads["l0"]["w"][0], acc.grads["l0"]["w"][1])  # each device its own sum
    assert acc.aux["accuracy"].shape == (4,)
    jdp.check_replicas(state)  # replicated parts still agree; the accumulator is exempt
    for k in (1, 2):
        state, m = step(state, micro[k])
    np.testing.assert_allclose(m["aux"]["accuracy"],
                               np.mean(np.concatenate([np.asarray(mlp_loss_acc(mlp_params(), b)[1]["accuracy"])[None]
                                                       for b in micro])), rtol=1e-6)
    assert np.all(np.asarray(jax.device_get(state.accum.grads["l0"]["w"])) == 0)  # emptied by the update


def test_validation_names_the_numbers():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=f"accum_steps={bad!r} must be an integer of at least 1"):
            jdp.make_train_step(mlp_loss, optax.sgd(0.1), accum_steps=bad)
    with pytest.raises(ValueError, match="accum_sync='first' is not supported"):
        jdp.make_train_step(mlp_loss, optax.sgd(0.1), accum_steps=2, accum_sync="first")
    step = jdp.make_train_step(mlp_loss, optax.sgd(0.1), devices=jax.devices()[:4], accum_steps=3)
    with pytest.raises(ValueError, match=r"global batch size 40 is not accum_steps × devices × b = 3 × 4 × b"):
        step.micro_batches(batches(1, 40)[0])
    state = step.init(mlp_params())
    with pytest.raises(ValueError, match="global batch size 6 does not divide evenly across 4 devices"):
        step(state, batches(1, 6)[0])


@pytest.mark.parametrize("backend", ["shard_map", "pmap"])
@pytest.mark.parametrize("m", [1, 2, 4])
def test_comm_report_counts_gradient_allreduces(backend, m):
    reports = {}
    for sync in ("every", "last"):
        step = jdp.make_train_step(mlp_loss, optax.adam(1e-2), backend=backend, devices=jax.devices()[:4],
                                   accum_steps=m, accum_sync=sync)
        state = step.init(mlp_params())
        reports[sync] = rep = jdp.comm_report(step, state, batches(1, 16)[0])
        grad_bytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves(mlp_params()))
        assert rep.gradient_bytes == grad_bytes
        grad_ars = [a for a in rep.allreduces if a.carries_gradients]
        assert len(grad_ars) == 1  # one all-reduce op carries the whole gradient (plus the loss)
        assert grad_bytes <= grad_ars[0].bytes <= grad_bytes + 64
        want = m if (sync == "every" or m == 1) else 1
        assert rep.gradient_allreduces_per_update == want
        assert grad_ars[0].runs == ("update only" if sync == "last" and m > 1 else "every call")
        np.testing.assert_allclose(rep.ring_bytes_per_device, 2 * 3 / 4 * rep.bytes_per_update)
    assert reports["every"].bytes_per_update >= m * reports["last"].bytes_per_update - 64 * m
