"""backend="jit", the global view: the loss sees the global batch, the partitioner reduces, the same step."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jdp
from jdp.core.options import StepOptions
from tests.helpers import batches, max_abs_diff, mlp_logits, mlp_loss, mlp_params

DEV = jax.devices()[:4]
GLOBAL = 32
SGD, ADAM = optax.sgd(0.5), optax.adam(1e-2)


def exact(loss, params, data, backends=("jit",), optimizers=(SGD, ADAM), **options):
    """assert_data_parallel_exact with SGD (a gradient's scale shows) and Adam; the worst |Δparam| of the jit runs."""
    worst = 0.0
    for tx in optimizers:
        report = jdp.testing.assert_data_parallel_exact(loss, tx, params, data, devices=DEV, backends=backends,
                                                        **options)
        worst = max([worst] + [r.diff for r in report.rows if r.run.startswith("jit") and r.name.startswith(
            ("params", "model_state"))])
    return worst


MODES = {
    "plain": {},
    "accum_every": dict(accum_steps=2, accum_sync="every"),
    "skip_nonfinite": dict(skip_nonfinite=True),
    "zero1": dict(shard_optimizer_state=True),
    "fsdp": dict(shard_params=True),
    "hybrid": dict(shard_params=True, replicas=2),
}


@pytest.mark.parametrize("mode", MODES)
def test_jit_equals_one_device(mode):
    options = MODES[mode]
    m = options.get("accum_steps", 1)
    backends = ("shard_map", "jit")  # where both apply, each equals one device: so they equal each other
    exact(mlp_loss, mlp_params(), batches(2, GLOBAL * m), backends=backends, **options)


def masked_batches(num=2, seed=3):
    """Batches whose real examples are spread unevenly over the 4 devices' shards (12, 2, 8, 5 of 8 each)."""
    data = batches(num, GLOBAL, seed=seed)
    mask = np.zeros(GLOBAL, np.float32)
    for d, real in enumerate((8, 2, 7, 5)):
        mask[d * 8:d * 8 + real] = 1.0
    return [dict(b, mask=mask) for b in data]


def per_example(params, batch):
    return optax.softmax_cross_entropy_with_integer_labels(mlp_logits(params, batch["x"]), batch["y"])


def global_token_mean(params, batch):
    """The global-view loss of jax.jit code: the summed loss over the batch's real examples divided by their count."""
    return jnp.sum(batch["mask"] * per_example(params, batch)) / jnp.sum(batch["mask"])


def test_a_loss_divided_by_the_whole_batchs_count_is_exact_under_jit_and_not_per_device():
    exact(global_token_mean, mlp_params(), masked_batches())
    with pytest.raises(jdp.testing.NotExactError):  # per device it is a mean of per-device means
        jdp.testing.assert_data_parallel_exact(global_token_mean, SGD, mlp_params(), masked_batches(), devices=DEV,
                                               backends=("shard_map",))


def test_weighted_and_mask_key_losses_are_exact_under_jit():
    weighted = lambda p, b: jdp.Weighted(jnp.sum(b["mask"] * per_example(p, b)), jnp.sum(b["mask"]))  # noqa: E731
    exact(weighted, mlp_params(), masked_batches())
    exact(weighted, mlp_params(), masked_batches(), optimizers=(SGD,), accum_steps=2)
    # mask_key: the loss sum(mask · l) / b is read as the mean over the real examples, i.e. global_token_mean
    masked = lambda p, b: jnp.sum(b["mask"] * per_example(p, b)) / b["mask"].shape[0]  # noqa: E731
    one = run(global_token_mean, DEV[:1], "shard_map", data=masked_batches(), mask_key=None)
    assert max_abs_diff(run(masked, DEV, "jit", data=masked_batches(), mask_key="mask"), one) <= 2e-6


def run(loss, devices, backend, data=None, tx=SGD, **options):
    """The params after a few steps of `loss` on `devices`."""
    step = jdp.make_train_step(loss, tx, devices=devices, backend=backend, **options)
    state = step.init(mlp_params(), seed=7)
    for b in data or batches(3, GLOBAL):
        state, _ = step(state, b)
    return jdp.get_params(state)


def bn_loss(params, state, batch):
    """A batch-normalised layer: statistics over the examples it is given, running mean in the state."""
    h = batch["x"] @ params["l0"]["w"]
    mean, var = h.mean(0), h.var(0)
    h = jnp.tanh((h - mean) / jnp.sqrt(var + 1e-5))
    logits = h @ params["l1"]["w"] + params["l1"]["b"]
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss, {"mean": 0.9 * state["mean"] + 0.1 * mean}


def test_model_state_is_the_global_batchs_statistics():
    params = mlp_params(sizes=(12, 16, 5))
    exact(bn_loss, {"l0": params["l0"], "l1": params["l1"]}, batches(2, GLOBAL, sizes=(12, 16, 5)), has_state=True,
          model_state={"mean": np.zeros(16, np.float32)})


def test_jdp_nnx_with_a_batchnorm_model_is_exact_under_jit():
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.l0, self.bn, self.l1 = nnx.Linear(12, 16, rngs=rngs), nnx.BatchNorm(16, rngs=rngs), nnx.Linear(16, 5, rngs=rngs)

        def __call__(self, x):
            return self.l1(jnp.tanh(self.bn(self.l0(x))))

    def loss(model, batch):
        return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"]).mean()

    exact(loss, Net(nnx.Rngs(0)), batches(2, GLOBAL), optimizers=(SGD,))


def test_bf16_compute_under_jit_is_one_bf16_devices_step():
    one, jit = run(mlp_loss, DEV[:1], "shard_map", precision="bfloat16"), run(mlp_loss, DEV, "jit", precision="bfloat16")
    shard_map = run(mlp_loss, DEV, "shard_map", precision="bfloat16")
    # bf16 computes: 5.3e-4 from float32 (measured; float32 jit is 6e-8 from it) ...
    assert max_abs_diff(jit, run(mlp_loss, DEV, "jit")) > 1e-4
    # ... and as far from one bf16 device as shard_map's 4 devices are (8.5e-4 and 6.1e-4, measured): the
    # rounding of bf16 partial sums in another order, no more
    assert max_abs_diff(one, jit) <= 2 * max_abs_diff(one, shard_map)


def test_dropout_keys_under_jit_are_one_devices():
    def loss(params, batch, key):
        keep = jax.random.bernoulli(key, 0.5, batch["x"].shape)
        return mlp_loss(params, dict(batch, x=batch["x"] * keep * 2.0))

    jit = run(loss, DEV, "jit", needs_rng=True)
    assert max_abs_diff(jit, run(loss, DEV[:1], "shard_map", needs_rng=True)) <= 2e-6
    assert max_abs_diff(jit, run(loss, DEV[:1], "shard_map", needs_rng=True, data=batches(3, GLOBAL, seed=5))) > 1e-3


REFUSED = [
    (dict(reduction="sum"), "reduction='sum' sums per-device gradients, and backend='jit' has none.*jdp explain"),
    (dict(reduction="sum", lr_correction="exact"), "reduction='sum'.*jdp explain"),
    (dict(accum_steps=2, accum_sync="last"), "under backend='jit' every call's gradient is all-reduced by the "
                                             "partitioner; use accum_sync='every' or backend='shard_map'"),
    (dict(reduce_dtype="bfloat16"), "reduce_dtype='bfloat16' cannot apply under backend='jit': the partitioner "
                                    "all-reduces the gradient inside the backward pass"),
    (dict(shard_params=True, gather_in_model=True), "gather_in_model=True cannot apply under backend='jit': the "
                                                    "partitioner gathers"),
    (dict(sync_batchnorm=False), "sync_batchnorm=False accepts per-device statistics, and under backend='jit'"),
]


@pytest.mark.parametrize("options,message", REFUSED, ids=[next(iter(o)) if len(o) == 1 else "+".join(o)
                                                          for o, _ in REFUSED])
def test_what_jit_cannot_mean_is_refused_in_one_sentence(options, message):
    with pytest.raises(ValueError, match=message) as e:
        jdp.make_train_step(mlp_loss, SGD, backend="jit", **options)
    assert str(e.value).count(". ") == 0 and str(e.value).endswith(".")


def test_a_loss_that_names_an_axis_is_refused_under_jit():
    def loss(params, batch):
        return jax.lax.pmean(mlp_loss(params, batch), "data")

    step = jdp.make_train_step(loss, SGD, devices=DEV, backend="jit")
    with pytest.raises(ValueError, match="loss_fn reduces over the mesh axis 'data'.*backend='jit' binds no axis"):
        step(step.init(mlp_params()), batches(1, GLOBAL)[0])


def test_the_psum_variant_stays_a_shard_map_option():
    assert StepOptions(backend="shard_map", reduction="sum").lr_correction == "auto"
    with pytest.raises(ValueError, match="jdp explain"):
        StepOptions(backend="jit", reduction="sum")


def test_checkpoints_move_between_jit_shard_map_and_pmap():
    data = batches(4, GLOBAL)

    def make(backend, **options):
        return jdp.make_train_step(mlp_loss, ADAM, devices=DEV, backend=backend, **options)

    jit = make("jit", shard_params=True)
    state = jit.init(mlp_params())
    for b in data[:2]:
        state, _ = jit(state, b)
    saved = jax.device_get(jit.canonical(state))
    ends = {}
    for name, step in (("jit", jit), ("shard_map", make("shard_map")), ("pmap", make("pmap")),
                       ("jit_zero1", make("jit", shard_optimizer_state=True))):
        moved = step.place(saved, step.init(mlp_params()))
        for b in data[2:]:
            moved, _ = step(moved, b)
        ends[name] = jdp.get_params(moved)
        # and back: this backend's canonical state resumes under jit
        back = jit.place(jax.device_get(step.canonical(moved)), jit.init(mlp_params()))
        assert max_abs_diff(jdp.get_params(back), ends[name]) == 0.0
    for name in ends:
        assert max_abs_diff(ends[name], ends["jit"]) <= 2e-6, name


def test_comm_and_memory_reports_read_the_jit_program():
    step = jdp.make_train_step(mlp_loss, ADAM, devices=DEV, backend="jit")
    state = step.init(mlp_params())
    batch = batches(1, GLOBAL)[0]
    report = jdp.comm_report(step, state, batch)
    assert report.gradient_allreduces_per_update == 1  # the partitioner's, one for the whole gradient here
    assert report.gradient_bytes <= report.bytes_per_update <= report.gradient_bytes + 16
    fsdp = jdp.make_train_step(mlp_loss, ADAM, devices=DEV, backend="jit", shard_params=True)
    memory = jdp.memory_report(fsdp, fsdp.init(mlp_params()), batch)
    assert "gathered by the partitioner (backend='jit')" in str(memory)
    assert memory.optimizer_state < jdp.memory_report(step, state).optimizer_state / 2


def tiny_gpt_step(**options):
    from jdp.models import GPT

    model = GPT(64, 16, d_model=64, n_heads=4, n_layers=2, dropout=0.0, scan_layers=True, remat=True,
                rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p, batch):
        logits = nnx.merge(graphdef, p, rest, copy=True)(batch["x"], train=False)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    step = jdp.make_train_step(loss, optax.adam(1e-3), devices=jax.devices()[:8], grad_norm=False, **options)
    rng = np.random.default_rng(0)
    return step, step.init(params), {k: rng.integers(0, 64, (16, 16)).astype(np.int32) for k in "xy"}


def test_the_gpt_residual_stream_is_pinned_batch_sharded_under_jit():
    step, state, batch = tiny_gpt_step(backend="jit", shard_params=True)
    report = jdp.comm_report(step, state, batch)
    reduced = sum(c.bytes for c in report.of_kind("all-reduce"))
    # pinned: the gradient is all-reduced once (measured 1.0x of it); unpinned the partitioner moves the
    # params' split into the activations and all-reduces 3.9x the gradient's bytes
    assert reduced <= 1.1 * report.gradient_bytes, (reduced, report.gradient_bytes)


def test_jdp_train_runs_digits_mlp_under_parallel_backend_jit_and_resumes(tmp_path):
    from jdp.config import load_config
    from jdp.train import train

    def run(backend, workdir, steps=6, stop_after=None):
        cfg = load_config(None, ["train.steps=6", "train.log_every=1", "train.checkpoint_every=2",
                                 "data.batch_size=64", f"parallel.backend={backend}"])
        train(cfg, str(workdir), devices=DEV, log=lambda *_: None, progress=False, stop_after=stop_after)
        with open(workdir / "metrics.jsonl") as f:
            return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}

    shard_map = run("shard_map", tmp_path / "a")
    jit = run("jit", tmp_path / "b")
    assert sorted(jit) == sorted(shard_map) and len(jit) == 6
    np.testing.assert_allclose([jit[s] for s in sorted(jit)], [shard_map[s] for s in sorted(jit)], rtol=1e-5)
    # parallel.backend is part of the run's identity (its dropout keys differ); a jit run resumes bit-exactly
    run("jit", tmp_path / "c", stop_after=4)
    assert run("jit", tmp_path / "c")[6] == jit[6]


def test_a_weighted_losss_metrics_are_the_global_batchs():
    weighted = lambda p, b: jdp.Weighted(jnp.sum(b["mask"] * per_example(p, b)), jnp.sum(b["mask"]))  # noqa: E731
    step = jdp.make_train_step(weighted, SGD, devices=DEV, backend="jit")
    batch = masked_batches(1)[0]
    _, metrics = step(step.init(mlp_params()), batch)
    assert float(metrics["weight"]) == batch["mask"].sum() == 22  # the step's real examples, all devices
    np.testing.assert_allclose(metrics["loss"], global_token_mean(mlp_params(), batch), rtol=1e-6)


def test_a_nonfinite_step_is_skipped_under_jit():
    step = jdp.make_train_step(mlp_loss, SGD, devices=DEV, backend="jit", skip_nonfinite=True, shard_params=True)
    state = step.init(mlp_params())
    bad = dict(batches(1, GLOBAL)[0])
    bad["x"] = bad["x"].copy()
    bad["x"][5, 0] = np.nan  # one example of one device's shard
    state, metrics = step(state, bad)
    assert bool(metrics["skipped"]) and int(state.skipped) == 1 and int(state.step) == 1
    assert max_abs_diff(jdp.get_params(state), mlp_params()) == 0.0
    state, metrics = step(state, batches(1, GLOBAL)[0])
    assert not bool(metrics["skipped"]) and max_abs_diff(jdp.get_params(state), mlp_params()) > 1e-3
