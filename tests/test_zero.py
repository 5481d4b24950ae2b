"""The optimizer state sharded over the devices (ZeRO-1): the same step, a fraction of the memory."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jdp
from tests.helpers import batches, mlp_loss, mlp_loss_acc, mlp_params
from tests.helpers import SHARDED_GLOBAL as GLOBAL
from tests.helpers import SHARDED_OPTIMIZERS as OPTIMIZERS, SHARDED_TOL as TOL


def run(n, optimizer, steps=5, loss=mlp_loss, **options):
    step = jdp.make_train_step(loss, optimizer, devices=jax.devices()[:n], **options)
    state = step.init(mlp_params())
    for batch in batches(steps * step.accum_steps, GLOBAL):
        state, metrics = step(state, batch)
    return step, state, metrics


def assert_close(a, b, tol=TOL):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=tol)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_sharded_equals_replicated_equals_one_device(name):
    spec = OPTIMIZERS[name]
    _, one, one_metrics = run(1, spec)
    moved = max(float(np.abs(p - p0).max()) for p, p0 in zip(jax.tree.leaves(jdp.get_params(one)),
                                                              jax.tree.leaves(mlp_params())))
    assert moved > 1e3 * TOL  # the params moved far more than the tolerance
    for n in (2, 4, 8):
        _, replicated, _ = run(n, spec)
        step, sharded, metrics = run(n, spec, shard_optimizer_state=True)
        assert_close(jdp.get_params(sharded), jdp.get_params(one))
        assert_close(jdp.get_params(sharded), jdp.get_params(replicated))
        # the optimizer state, gathered back into the params' shapes, is the replicated one
        assert_close(step.canonical(sharded).opt_state, jax.device_get(replicated.opt_state))
        np.testing.assert_allclose(metrics["grad_norm"], one_metrics["grad_norm"], rtol=1e-6)


@pytest.mark.parametrize("accum_sync,reduction,lr_correction", [
    ("every", "mean", None), ("last", "mean", None), ("last", "sum", "exact"), ("every", "sum", "auto")])
def test_accumulation_and_psum_variant(accum_sync, reduction, lr_correction):
    spec = OPTIMIZERS["adamw_clip"] if lr_correction != "auto" else OPTIMIZERS["momentum"]
    options = dict(accum_steps=2, accum_sync=accum_sync, reduction=reduction, lr_correction=lr_correction)
    _, one, _ = run(1, spec, steps=3, **options)
    step, sharded, _ = run(4, spec, steps=3, shard_optimizer_state=True, **options)
    assert_close(jdp.get_params(sharded), jdp.get_params(one))
    report = jdp.comm_report(step, sharded, batches(1, GLOBAL)[0])
    scatters = report.of_kind("reduce-scatter")
    # "last" keeps its local sums and scatters once per optimizer step, on the update call
    assert [c.executions_per_update for c in scatters] == [2 if accum_sync == "every" else 1]


def test_one_reduce_scatter_and_one_all_gather_replace_the_gradient_allreduce():
    for n in (2, 4, 8):
        step, state, _ = run(n, OPTIMIZERS["adam"], steps=1, shard_optimizer_state=True)
        report = jdp.comm_report(step, state, batches(1, GLOBAL)[0])
        leaves = jax.tree.leaves(mlp_params())
        split = sum(x.nbytes for x in leaves if jdp.zero.split_dim(x.shape, n) >= 0)  # the leaves n devices split
        assert [c.bytes for c in report.of_kind("reduce-scatter")] == [split]
        assert [c.bytes for c in report.of_kind("all-gather")] == [split]
        # the whole leaves' gradient (a bias of 5), the loss, example count and norm: one small all-reduce
        assert all(c.bytes <= sum(x.nbytes for x in leaves) - split + 64 for c in report.allreduces)
        assert report.gradient_allreduces_per_update == 0
        replicated_step, replicated, _ = run(n, OPTIMIZERS["adam"], steps=1)
        ring = jdp.comm_report(replicated_step, replicated, batches(1, GLOBAL)[0]).ring_bytes_per_device
        # a ring all-reduce is a reduce-scatter plus an all-gather: the same traffic, up to padding
        assert abs(report.ring_bytes_per_device - ring) <= 64


def test_optimizer_state_bytes_per_device_are_one_nth():
    full = None
    for n in (1, 2, 4, 8):
        step, state, _ = run(n, optax.adam(1e-3), steps=1, shard_optimizer_state=n > 1)
        report = jdp.memory_report(step, state, batches(1, GLOBAL)[0])
        if n == 1:
            full = report.optimizer_state
            continue
        assert report.sharded and report.params == report.gradient and full == 2 * report.params + 4  # mu, nu, count
        assert report.reduced_gradient < report.gradient / n * 1.1
        # mu and nu are split as the params are (the bias of 5 stays whole); the step count is replicated
        assert full / n < report.optimizer_state == 2 * report.reduced_gradient + 4 < full / n * 1.1
        _, replicated, _ = run(n, optax.adam(1e-3), steps=1)
        assert jdp.memory_report(step, replicated).optimizer_state == full


def test_nonfinite_step_is_skipped_on_every_device():
    # The gradient of "gate" is the batch mean of "g": an inf in column 3 makes it inf in element 3
    # only, which on 4 devices is device 3's slice alone. Every device must skip, not just that one.
    def loss(params, batch):
        return mlp_loss(params["mlp"], batch) + jnp.mean(batch["g"] @ params["gate"])

    params = {"mlp": mlp_params(), "gate": np.zeros(4, np.float32)}
    data = [dict(b, g=np.ones((GLOBAL, 4), np.float32)) for b in batches(3, GLOBAL)]
    data[1]["g"][5, 3] = np.inf
    results = []
    for shard in (False, True):
        step = jdp.make_train_step(loss, OPTIMIZERS["adam"], devices=jax.devices()[:4], skip_nonfinite=True,
                                   shard_optimizer_state=shard)
        state, _ = step(step.init(params), data[0])
        before = jdp.get_params(state)
        state, metrics = step(state, data[1])
        assert bool(metrics["skipped"]) and int(state.skipped) == 1
        assert_close(jdp.get_params(state), before, tol=0)
        state, _ = step(state, data[2])
        results.append(jdp.get_params(state))
    assert_close(results[1], results[0])


def test_model_state_mask_aux_and_mixed_precision():
    def loss(params, stats, batch):
        value, aux = mlp_loss_acc(params, batch)
        return value, (aux, 0.9 * stats + 0.1 * jnp.mean(batch["x"]))

    batch = dict(batches(1, GLOBAL)[0], mask=np.r_[np.ones(GLOBAL - 3), np.zeros(3)].astype(np.float32))
    finals = []
    for shard in (False, True):
        step = jdp.make_train_step(loss, OPTIMIZERS["adam"], devices=jax.devices()[:4], has_state=True, has_aux=True, mask_key="mask",
                                   precision="bf16", reduce_dtype="bf16", shard_optimizer_state=shard,
                                   sync_batchnorm=False)  # a per-device running mean, averaged
        state = step.init(mlp_params(), np.float32(0.0))
        for _ in range(3):
            state, metrics = step(state, batch)
        finals.append((jdp.get_params(state), state.model_state, metrics["aux"]["accuracy"]))
    # bf16 rounds the same values at the same points in both layouts
    assert_close(finals[1], finals[0], tol=1e-6)


def test_resume_across_layouts_and_device_counts_is_exact():
    spec, data = OPTIMIZERS["adamw_clip"], batches(5, GLOBAL)
    one = jdp.make_train_step(mlp_loss, spec, devices=jax.devices()[:1])
    state = one.init(mlp_params())
    for b in data:
        state, _ = one(state, b)
    for first, second in (((8, True), (2, False)), ((2, False), (4, True))):
        a = jdp.make_train_step(mlp_loss, spec, devices=jax.devices()[:first[0]], shard_optimizer_state=first[1])
        s = a.init(mlp_params())
        for b in data[:3]:
            s, _ = a(s, b)
        canonical = jax.device_get(a.canonical(s))  # what a checkpoint holds
        b_step = jdp.make_train_step(mlp_loss, spec, devices=jax.devices()[:second[0]], shard_optimizer_state=second[1])
        s = b_step.place(canonical, like=b_step.init(mlp_params()))
        for b in data[3:]:
            s, _ = b_step(s, b)
        assert_close(jdp.get_params(s), jdp.get_params(state))


def test_nnx_model_with_sharded_optimizer_state():
    def make():
        return nnx.Sequential(nnx.Linear(12, 16, rngs=nnx.Rngs(0)), nnx.relu, nnx.Linear(16, 5, rngs=nnx.Rngs(1)))

    def loss_fn(model, batch):
        return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"]).mean()

    finals = []
    for shard in (False, True):
        model = make()
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        step = jdp.nnx.make_train_step(model, loss_fn, optimizer, devices=jax.devices()[:4],
                                       shard_optimizer_state=shard)
        state = step.init()
        for b in batches(3, GLOBAL):
            state, _ = step(state, b)
        if shard:  # its optimizer state is in slices: update_model says how to gather it
            with pytest.raises(ValueError, match=r"pass train_step\.canonical\(state\), which gathers it"):
                jdp.nnx.update_model(model, state, optimizer)
        jdp.nnx.update_model(model, step.canonical(state), optimizer)
        finals.append((nnx.state(model, nnx.Param), nnx.state(optimizer, nnx.optimizer.OptState)))
    assert_close(finals[1], finals[0])


def test_refusals_name_the_problem():
    with pytest.raises(ValueError, match=r"shard_optimizer_state=True needs backend='shard_map' or 'jit' \(got 'pmap'\)"):
        jdp.make_train_step(mlp_loss, optax.adam(1e-3), backend="pmap", shard_optimizer_state=True)
    with pytest.raises(ValueError, match=r"shard_optimizer_state='yes' must be True or False"):
        jdp.make_train_step(mlp_loss, optax.adam(1e-3), shard_optimizer_state="yes")


def test_padding_never_decides_a_skip():
    # Adam with eps=0 turns a zero gradient into 0/0 = NaN. The real gradients here are never 0,
    # but the padding slots' are: the sharded step must not skip for them.
    spec = optax.adam(1e-2, eps=0.0)
    _, replicated, _ = run(4, spec, steps=3, skip_nonfinite=True)
    _, sharded, _ = run(4, spec, steps=3, skip_nonfinite=True, shard_optimizer_state=True)
    assert int(replicated.skipped) == int(sharded.skipped) == 0
    assert_close(jdp.get_params(sharded), jdp.get_params(replicated))


def test_config_key_and_its_refusal():
    from jdp.config import load_config
    from jdp.run.sections import ConfigError

    assert load_config(None, ["parallel.shard_optimizer_state=true"]).parallel.shard_optimizer_state is True
    with pytest.raises(ConfigError, match=r"^parallel\.shard_optimizer_state: shard_optimizer_state=True needs "
                                          r"backend='shard_map' or 'jit' \(got 'pmap'\)"):
        load_config(None, ["parallel.backend=pmap", "parallel.shard_optimizer_state=true"])
    with pytest.raises(ConfigError, match=r"^parallel\.shard_optimizer_state must be true or false, got 'maybe'\.$"):
        load_config(None, ["parallel.shard_optimizer_state=maybe"])


def test_leaves_of_two_dtypes_scatter_and_gather_per_dtype():
    # One reduce-scatter and one all-gather per dtype: a float32 and a bfloat16 leaf (and float32
    # precision, so bf16 params are allowed) come back in their own dtypes and values.
    def loss(params, batch):
        h = batch["x"] @ params["w"] + params["b"].astype(jnp.float32) + params["c"].astype(jnp.float32).sum(1)
        return jnp.mean((h - batch["t"]) ** 2)

    params = {"w": np.linspace(-1, 1, 24, dtype=np.float32).reshape(8, 3), "b": np.zeros(3, jnp.bfloat16),
              "c": np.zeros((3, 4), jnp.bfloat16)}
    batch = {"x": np.linspace(0, 1, 64, dtype=np.float32).reshape(8, 8), "t": np.ones((8, 3), np.float32)}
    finals, reports = [], []
    for shard in (False, True):
        step = jdp.make_train_step(loss, optax.adam(1e-2), devices=jax.devices()[:4], shard_optimizer_state=shard)
        state = step.init(params)
        for _ in range(3):
            state, _ = step(state, batch)
        finals.append(jdp.get_params(state))
        reports.append(jdp.comm_report(step, state, batch))
    assert finals[1]["b"].dtype == jnp.bfloat16 and finals[1]["w"].dtype == np.float32
    assert_close(finals[1], finals[0], tol=0)
    assert len(reports[1].of_kind("reduce-scatter")) == len(reports[1].of_kind("all-gather")) == 2


def test_a_stacked_leaf_is_split_after_its_layer_axis_even_where_that_axis_is_the_largest():
    # A scanned model's stacked leaf (layers, ...): 8 layers of a (4,) bias over 4 devices. Its largest
    # dimension that 4 divides is the layer axis; split there a device would hold 2 whole layers.
    assert jdp.zero.split_dim((8, 4), 4) == 1
    assert jdp.zero.split_dim((16, 4, 8), 4) == 2  # the largest after the first
