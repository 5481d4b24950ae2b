"""Params, gradient and optimizer state sharded over the devices (FSDP): the same step, 1/N of the state."""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training.train_state import TrainState as LinenTrainState

import jdp
import jdp.linen
from jdp.zero import split_dim
from tests.helpers import batches, max_abs_diff, mlp_loss, mlp_loss_acc, mlp_params
from tests.helpers import SHARDED_GLOBAL as GLOBAL
from tests.helpers import SHARDED_OPTIMIZERS as OPTIMIZERS, SHARDED_TOL as TOL
DATA = batches(10, GLOBAL)


@functools.lru_cache(maxsize=None)
def make(n, name, **options):
    """One step per configuration, shared by the tests below (compiling dominates their time)."""
    return jdp.make_train_step(mlp_loss, OPTIMIZERS[name], devices=jax.devices()[:n], **options)


@functools.lru_cache(maxsize=None)
def run(n, name, steps=5, **options):
    step = make(n, name, **options)
    state = step.init(mlp_params())
    for batch in DATA[:steps * step.accum_steps]:
        state, metrics = step(state, batch)
    return step, state, metrics


def assert_close(a, b, tol=TOL):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert np.shape(x) == np.shape(y)
        np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=0, atol=tol)


def split_leaves(n):
    """The MLP's float32 leaves that n devices split (one of their dimensions divides by n), and the whole ones."""
    leaves = jax.tree.leaves(mlp_params())
    return ([x for x in leaves if split_dim(x.shape, n) >= 0], [x for x in leaves if split_dim(x.shape, n) < 0])


def held_bytes(n):
    """Bytes one of n devices keeps of the params: a block of each split leaf, every whole one."""
    split, whole = split_leaves(n)
    return sum(x.nbytes // n for x in split) + sum(x.nbytes for x in whole)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_fsdp_equals_replicated_equals_one_device(name):
    _, one, one_metrics = run(1, name)
    assert max_abs_diff(jdp.get_params(one), mlp_params()) > 1e3 * TOL  # the params moved far more than TOL
    _, replicated, _ = run(4, name)
    for n in (2, 4, 8):
        step, sharded, metrics = run(n, name, shard_params=True)
        assert_close(jdp.get_params(sharded), jdp.get_params(one))
        # the optimizer state, gathered into the params' shapes, is the one device's
        assert_close(step.canonical(sharded).opt_state, jax.device_get(one.opt_state))
        np.testing.assert_allclose(metrics["grad_norm"], one_metrics["grad_norm"], rtol=1e-6)
    assert_close(jdp.get_params(run(4, name, shard_params=True)[1]), jdp.get_params(replicated))


def test_params_and_optimizer_state_are_one_nth_per_device():
    total = held_bytes(1)
    _, replicated, _ = run(4, "adam")
    for n in (2, 4, 8):
        step, state, _ = run(n, "adam", shard_params=True)
        for leaf, kept in zip(jax.tree.leaves(mlp_params()), jax.tree.leaves(state.params)):
            assert kept.shape == leaf.shape  # one global array in the leaf's own shape
            held = kept.addressable_shards[0].data  # what device 0 keeps of this leaf
            k = split_dim(leaf.shape, n)
            assert held.shape == tuple(s // n if d == k else s for d, s in enumerate(leaf.shape))
        assert sum(x.nbytes for x in split_leaves(n)[1]) < total / 20  # nearly all of the model is split
        jdp.check_replicas(state)  # the replicated leaves (counters, step count) agree; blocks are not copies
        report = jdp.memory_report(step, state)
        assert report.params_sharded and report.sharded and report.gradient == total
        assert report.params == report.reduced_gradient == held_bytes(n)
        assert report.optimizer_state <= 2 * held_bytes(n) + 8  # mu, nu; the step count
        # the params come back whole, in their shapes and dtypes, and hold what the replicated step computes
        whole = jdp.get_params(state)
        assert [(x.shape, x.dtype) for x in jax.tree.leaves(whole)] == [
            (x.shape, x.dtype) for x in jax.tree.leaves(mlp_params())]
        assert_close(whole, jdp.get_params(replicated))
    assert jdp.memory_report(make(4, "adam"), replicated).params == total


def test_collectives_gather_params_scatter_gradient_and_no_gradient_allreduce():
    for n in (2, 4, 8):
        step, state, _ = run(n, "adam", shard_params=True)
        report = jdp.comm_report(step, state, DATA[0])
        split, whole = split_leaves(n)
        gathers = report.of_kind("all-gather")
        # one all-gather per split params leaf, for the forward and backward pass; nothing gathered after the update
        assert sorted(c.bytes for c in gathers) == sorted(x.nbytes for x in split)
        assert [c.bytes for c in report.of_kind("reduce-scatter")] == [sum(x.nbytes for x in split)]
        # the whole leaves' gradient, the loss, example count and norm: one small all-reduce
        assert all(c.bytes <= sum(x.nbytes for x in whole) + 64 for c in report.allreduces)
        assert report.gradient_allreduces_per_update == 0
        small = sum(c.ring_bytes(n) for c in report.allreduces)
        assert report.ring_bytes_per_device == pytest.approx(2 * (n - 1) / n * sum(x.nbytes for x in split) + small)
    # the replicated all-reduce's ring traffic, the same up to padding
    ring = jdp.comm_report(make(4, "adam"), run(4, "adam")[1], DATA[0]).ring_bytes_per_device
    fsdp = jdp.comm_report(make(4, "adam", shard_params=True), run(4, "adam", shard_params=True)[1], DATA[0])
    assert abs(fsdp.ring_bytes_per_device - ring) <= 64


@pytest.mark.parametrize("accum_sync,reduction,lr_correction", [
    ("every", "mean", None), ("last", "mean", None), ("last", "sum", "exact"), ("every", "sum", "auto")])
def test_accumulation_and_psum_variant(accum_sync, reduction, lr_correction):
    name = "adamw_clip" if lr_correction != "auto" else "momentum"
    options = dict(accum_steps=2, accum_sync=accum_sync, reduction=reduction, lr_correction=lr_correction)
    _, one, _ = run(1, name, steps=3, **options)
    step, sharded, _ = run(4, name, steps=3, shard_params=True, **options)
    assert_close(jdp.get_params(sharded), jdp.get_params(one))
    report = jdp.comm_report(step, sharded, DATA[0])
    # the params are gathered on every call (both micro-batches); the gradient is reduce-scattered on
    # every call ("every"), or once per optimizer step from the local sums ("last")
    assert {c.executions_per_update for c in report.of_kind("all-gather")} == {2}
    assert [c.executions_per_update for c in report.of_kind("reduce-scatter")] == [2 if accum_sync == "every" else 1]
    assert report.gradient_allreduces_per_update == 0
    memory = jdp.memory_report(step, sharded)
    # "last" keeps this device's gradient sums whole; "every" accumulates slices in the optimizer state
    assert (memory.accumulator >= memory.gradient) == (accum_sync == "last")


def test_model_state_mask_aux_and_bf16_compute():
    def loss(params, stats, batch):
        value, aux = mlp_loss_acc(params, batch)
        # a running mean over the global batch (synchronised, as BatchNorm with axis_name="data")
        return value, (aux, 0.9 * stats + 0.1 * jax.lax.pmean(jnp.mean(batch["x"]), "data"))

    batch = dict(DATA[0], mask=np.r_[np.ones(GLOBAL - 3), np.zeros(3)].astype(np.float32))
    for reduce_dtype in (None, "bf16"):
        finals = []
        for shard in (False, True):
            step = jdp.make_train_step(loss, OPTIMIZERS["adam"], devices=jax.devices()[:4], has_state=True,
                                       has_aux=True, precision="bf16", reduce_dtype=reduce_dtype, shard_params=shard,
                                       mask_key="mask")
            state = step.init(mlp_params(), np.float32(0.0))
            for _ in range(3):
                state, metrics = step(state, batch)
            finals.append((jdp.get_params(state), state.model_state, metrics["aux"]["accuracy"]))
        # the params are gathered in bf16, which the loss computes with anyway, and the gradient is cast back
        # to float32 before it is reduced: bf16 rounds the same values at the same points in both layouts (a
        # float32 reduce-scatter may add the devices' values in another order than the all-reduce: 1e-6)
        assert_close(finals[1], finals[0], tol=1e-6)
        program = jdp.inspect.comm.parse_collectives(step.lower(state, batch).as_text(dialect="hlo"))
        split = sum(x.nbytes for x in split_leaves(4)[0])
        assert sum(c["bytes"] for c in program if c["kind"] == "all-gather") == split // 2  # bf16: half
        scattered = [c["bytes"] for c in program if c["kind"] == "reduce-scatter"]
        assert scattered == [split // (2 if reduce_dtype else 1)]


class Tiny(nnx.Module):
    def __init__(self, *, rngs):
        self.linear = nnx.Linear(12, 9, use_bias=False, rngs=rngs)  # split along 12 on 4 devices; 9 stays whole
        self.bn = nnx.BatchNorm(9, rngs=rngs)
        self.head = nnx.Linear(9, 5, rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.relu(self.bn(self.linear(x))))


def test_nnx_model_with_batchnorm_equals_one_device():
    def loss_fn(model, batch):
        return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"]).mean()

    finals = []
    for n, shard in ((1, False), (4, True)):
        model = Tiny(rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        step = jdp.nnx.make_train_step(model, loss_fn, optimizer, devices=jax.devices()[:n], shard_params=shard)
        state = step.init()
        for b in DATA[:3]:
            state, _ = step(state, b)
        if shard:  # its optimizer state is in slices: update_model says how to gather it
            with pytest.raises(ValueError, match=r"pass train_step\.canonical\(state\), which gathers it"):
                jdp.nnx.update_model(model, state, optimizer)
            jdp.nnx.update_model(model, state)  # params and statistics alone come back whole
            finals.append(nnx.state(model, nnx.BatchStat))
        jdp.nnx.update_model(model, step.canonical(state), optimizer)
        finals.append((nnx.state(model, nnx.Param), nnx.state(model, nnx.BatchStat),
                       nnx.state(optimizer, nnx.optimizer.OptState)))
    assert_close(finals[1], finals[0][1])
    assert_close(finals[2], finals[0])


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(5)(jnp.tanh(nn.Dense(7)(x)))


def test_linen_train_state_equals_one_device_and_hands_back():
    model = LinenMLP()
    start = LinenTrainState.create(apply_fn=model.apply, params=model.init(jax.random.key(0), jnp.zeros((1, 12)))[
        "params"], tx=optax.adam(1e-2))

    def loss_fn(params, batch):
        logits = start.apply_fn({"params": params}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    backs = []
    for n, shard in ((1, False), (2, True)):
        step, state = jdp.linen.make_train_step(start, loss_fn, devices=jax.devices()[:n], shard_params=shard)
        for b in DATA[:3]:
            state, _ = step(state, b)
        if shard:
            with pytest.raises(ValueError, match=r"pass train_step\.canonical\(state\)"):
                jdp.linen.to_train_state(start, state)
            state = step.canonical(state)
        backs.append(jdp.linen.to_train_state(start, state))
    assert int(backs[1].step) == 3
    assert_close((backs[1].params, backs[1].opt_state), (backs[0].params, backs[0].opt_state))


def test_nonfinite_step_is_skipped_on_every_device():
    # The gradient of "gate" is the batch mean of "g": an inf in column 3 makes it inf in element 3
    # only, which on 4 devices lies in device 3's block alone. Every device must keep its blocks.
    def loss(params, batch):
        return mlp_loss(params["mlp"], batch) + jnp.mean(batch["g"] @ params["gate"])

    params = {"mlp": mlp_params(), "gate": np.zeros(4, np.float32)}
    data = [dict(b, g=np.ones((GLOBAL, 4), np.float32)) for b in DATA[:2]]
    data[1]["g"][5, 3] = np.inf
    step = jdp.make_train_step(loss, OPTIMIZERS["adam"], devices=jax.devices()[:4], skip_nonfinite=True,
                               shard_params=True)
    state, _ = step(step.init(params), data[0])
    before = jdp.get_params(state)
    state, metrics = step(state, data[1])
    assert bool(metrics["skipped"]) and int(state.skipped) == 1
    assert_close(jdp.get_params(state), before, tol=0)


def test_canonical_state_moves_between_layouts_and_device_counts():
    _, whole, _ = run(1, "adamw_clip")
    for (n1, shard1), (n2, shard2) in (((8, True), (4, False)), ((4, False), (2, True))):
        first = make(n1, "adamw_clip", **({"shard_params": True} if shard1 else {}))
        state = first.init(mlp_params())
        for b in DATA[:3]:
            state, _ = first(state, b)
        canonical = jax.device_get(first.canonical(state))  # what a checkpoint holds: the params' shapes
        assert [np.shape(x) for x in jax.tree.leaves(canonical.params)] == [
            x.shape for x in jax.tree.leaves(mlp_params())]
        second = make(n2, "adamw_clip", **({"shard_params": True} if shard2 else {}))
        state = second.place(canonical, like=second.init(mlp_params()))
        for b in DATA[3:5]:
            state, _ = second(state, b)
        assert_close(jdp.get_params(state), jdp.get_params(whole))


def test_trainer_resumes_across_shard_params_and_device_counts(tmp_path):
    from jdp.config import load_config
    from jdp.train import train

    def config(*extra):
        return load_config(None, ["train.steps=4", "train.log_every=1", "train.checkpoint_every=2",
                                  "data.batch_size=64", "model.hidden=[16]", "optim.clip_norm=1.0", *extra])

    def go(cfg, workdir, n, stop_after=None):
        return train(cfg, str(workdir), devices=jax.devices()[:n], log=lambda *_: None, progress=False,
                     stop_after=stop_after)

    whole = go(config(), tmp_path / "whole", 2)
    go(config("parallel.shard_params=true"), tmp_path / "a", 4, stop_after=2)  # FSDP on 4 devices ...
    last = go(config(), tmp_path / "a", 2)  # ... resumed replicated on 2: one run
    assert last.resumed_from == 2 and last.steps == 4
    assert max_abs_diff(last.params, whole.params) <= 2e-6


def test_refusals_and_config_key():
    from jdp.config import load_config
    from jdp.run.sections import ConfigError

    with pytest.raises(ValueError, match=r"^shard_params=True needs backend='shard_map' or 'jit' \(got 'pmap'\): pmap keeps a "
                                         r"whole copy of the params on every device\.$"):
        jdp.make_train_step(mlp_loss, optax.adam(1e-3), backend="pmap", shard_params=True)
    with pytest.raises(ValueError, match=r"shard_params='yes' must be True or False"):
        jdp.make_train_step(mlp_loss, optax.adam(1e-3), shard_params="yes")
    assert jdp.make_train_step(mlp_loss, optax.adam(1e-3), shard_params=True).options.shard_optimizer_state
    config = load_config(None, ["parallel.shard_params=true"])
    assert config.parallel.shard_params is True
    with pytest.raises(ConfigError, match=r"^parallel\.shard_params: shard_params=True needs backend='shard_map'"):
        load_config(None, ["parallel.backend=pmap", "parallel.shard_params=true"])
    with pytest.raises(ConfigError, match=r"^parallel\.shard_params must be true or false, got 'maybe'\.$"):
        load_config(None, ["parallel.shard_params=maybe"])


def test_the_leaves_kept_whole_are_named_with_their_bytes(tmp_path):
    """A leaf no dimension of which N divides stays whole on every device: memory_report and jdp train's
    memory line name it and its bytes (the MLP's bias of 5 on 4 devices; nothing on one device)."""
    from jdp.config import load_config
    from jdp.train import train

    step, state, _ = run(4, "adam", shard_params=True)
    report = jdp.memory_report(step, state)
    assert report.whole == (("['l2']['b']", 20),)
    assert str(report).endswith("; 1 params leaf stays whole on every device with its optimizer state, 20 B, as no "
                                "dimension of it divides by 4: ['l2']['b'] 20 B")
    zero = make(4, "adam", shard_optimizer_state=True)
    assert jdp.memory_report(zero, zero.init(mlp_params())).whole == report.whole
    assert jdp.memory_report(make(4, "adam"), run(4, "adam")[1]).whole == ()  # replicated: nothing is split
    lines = []
    config = load_config(None, ["train.steps=1", "train.eval_every=0", "data.batch_size=64", "model.hidden=[16]",
                                "parallel.shard_params=true"])
    train(config, str(tmp_path / "w"), devices=jax.devices()[:4], log=lines.append, progress=False)
    said = next(line for line in lines if line.startswith("memory per device"))
    assert said.endswith("; 1 params leaf stays whole on every device with its optimizer state, 40 B, as no dimension "
                         "of it divides by 4: ['layers'][1]['bias'] 40 B"), said
