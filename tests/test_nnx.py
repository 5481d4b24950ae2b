"""jdp.nnx: bad input in one sentence, and the step working with jdp's tools and nnx.Optimizer."""
import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jdp


class Tiny(nnx.Module):
    def __init__(self, *, rngs):
        self.linear = nnx.Linear(6, 8, use_bias=False, rngs=rngs)  # a bias before BatchNorm has a zero gradient
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.head = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.relu(self.bn(self.linear(x))))


def loss_fn(model, batch):
    logits = model(batch["x"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss, {"accuracy": (logits.argmax(-1) == batch["y"]).mean()}


def metric_fn(model, batch):
    logits = model(batch["x"])
    return {"loss": optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]),
            "accuracy": (logits.argmax(-1) == batch["y"]).astype(np.float32)}


def data(n, seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.normal(size=(n, 6)).astype(np.float32), "y": rng.integers(0, 3, n).astype(np.int32)}


def test_bad_input_is_one_sentence():
    model = Tiny(rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="model must be an nnx.Module, got dict"):
        jdp.nnx.make_train_step({"w": np.ones(3)}, loss_fn, optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"loss_fn must take \(model, batch\); its signature is \(model\)"):
        jdp.nnx.make_train_step(model, lambda model: 0.0, optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"loss_fn must take \(model, batch, rngs\)"):
        jdp.nnx.make_train_step(model, loss_fn, optax.sgd(0.1), needs_rng=True)
    with pytest.raises(ValueError, match=r"^loss_fn takes \(model, batch, rngs\), one argument more than \(model, "
                                         r"batch\): pass needs_rng=True if the last is a random key \(jdp then passes "
                                         r"an nnx.Rngs from the seed, the micro-step and the device\)\.$"):
        jdp.nnx.make_train_step(model, lambda model, batch, rngs: 0.0, optax.sgd(0.1))
    other = nnx.Optimizer(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), optax.adam(1e-3), wrt=nnx.Param)
    with pytest.raises(ValueError, match="the nnx.Optimizer was built for another model"):
        jdp.nnx.make_train_step(model, loss_fn, other)
    with pytest.raises(ValueError, match="has_state is set by jdp.nnx.make_train_step"):
        jdp.nnx.make_train_step(model, loss_fn, optax.sgd(0.1), has_state=True)


def test_step_works_with_jdps_tools_and_hands_back_to_nnx_optimizer():
    model = Tiny(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    step = jdp.nnx.make_train_step(model, loss_fn, optimizer, has_aux=True, devices=jax.devices()[:4])
    state = step.init(seed=0)
    batch = data(16)
    for _ in range(3):
        state, metrics = step(state, batch)
    jdp.check_replicas(state)
    report = jdp.comm_report(step, state, batch)  # the gradient crosses the devices once per call
    assert report.gradient_bytes <= report.bytes_per_update < 3 * report.gradient_bytes
    assert float(metrics["aux"]["accuracy"]) >= 0.0

    # The one-device nnx loop continues from where jdp stopped, with the optimizer state handed over.
    jdp.nnx.update_model(model, state, optimizer)
    assert int(optimizer.step.get_value()) == 3
    ref = Tiny(rngs=nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def one_device(model, optimizer, batch):
        grads = nnx.grad(lambda m: loss_fn(m, batch)[0])(model)
        optimizer.update(model, grads)

    for _ in range(4):
        one_device(ref, ref_opt, batch)
    one_device(model, optimizer, batch)
    for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(nnx.state(ref, nnx.Param))):
        np.testing.assert_allclose(a, b, atol=2e-5)


def test_evaluation_through_the_state_equals_the_updated_model():
    model = Tiny(rngs=nnx.Rngs(1))
    step = jdp.nnx.make_train_step(model, loss_fn, optax.sgd(0.1), has_aux=True, devices=jax.devices()[:4])
    state, _ = step(step.init(seed=0), data(16))
    held_out = data(37, seed=1)  # not a multiple of the batch: the last batch is padded and masked
    got = step.evaluate(state, metric_fn, held_out, batch_size=8)
    jdp.nnx.update_model(model, state)
    model.eval()
    want = {k: float(np.mean(v)) for k, v in metric_fn(model, held_out).items()}
    assert got.keys() == want.keys()
    for k in got:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, err_msg=k)
    with pytest.raises(ValueError, match="metric_fn's 'mean' has shape \\(\\); it must hold one value per example"):
        step.evaluate(state, lambda m, b: {"mean": m(b["x"]).mean()}, held_out, batch_size=8)


def test_save_and_restore_state_in_one_call_each_across_device_counts(tmp_path):
    model = Tiny(rngs=nnx.Rngs(2))
    four = jdp.nnx.make_train_step(model, loss_fn, optax.adam(1e-2), has_aux=True, devices=jax.devices()[:4])
    state, _ = four(four.init(seed=3), data(16))
    assert jdp.save_state(str(tmp_path / "ckpt"), four, state) == 1
    two = jdp.nnx.make_train_step(model, loss_fn, optax.adam(1e-2), has_aux=True, devices=jax.devices()[:2],
                                  backend="pmap")
    restored = jdp.restore_state(str(tmp_path / "ckpt"), two, two.init(seed=0))
    for name in ("params", "opt_state", "model_state", "rng", "step"):
        for a, b in zip(jax.tree.leaves(jdp.step.get_tree(state, getattr(state, name))),
                        jax.tree.leaves(jdp.step.get_tree(restored, getattr(restored, name)))):
            np.testing.assert_array_equal(a, b, err_msg=name)
    batch = data(16, seed=5)  # and both continue identically
    np.testing.assert_allclose(jdp.get_params(four(state, batch)[0])["head"]["kernel"],
                               jdp.get_params(two(restored, batch)[0])["head"]["kernel"], rtol=1e-5, atol=1e-7)


class DropoutNet(nnx.Module):
    def __init__(self, *, rngs):
        self.linear = nnx.Linear(6, 8, use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)  # stored rngs: reseeded per device and micro-step
        self.head = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        return self.head(self.dropout(nnx.relu(self.bn(self.linear(x)))))


def test_stored_rngs_are_reseeded_per_device():
    # Every device gets the same 8 examples. With each device's own dropout mask (its stored
    # nnx.Rngs reseeded from its key) the 2-device gradient averages two different masks; with one
    # mask on every device it would equal the 1-device step on those 8 examples.
    batch = data(8, seed=3)
    twice = {k: np.concatenate([v, v]) for k, v in batch.items()}

    def model():
        return nnx.Sequential(nnx.Dropout(0.5, rngs=nnx.Rngs(0)), nnx.Linear(6, 3, rngs=nnx.Rngs(0)))

    steps = {n: jdp.nnx.make_train_step(model(), loss_fn, optax.sgd(0.5), has_aux=True, devices=jax.devices()[:n])
             for n in (1, 2)}

    def trained(n, global_batch):
        return jdp.get_params(steps[n](steps[n].init(seed=0), global_batch)[0])["layers"][1]["kernel"]

    one, two = trained(1, batch), trained(2, twice)
    assert np.abs(one - two).max() > 1e-3
    np.testing.assert_array_equal(trained(2, twice), two)  # and the masks come from the seed: reproducible


def test_your_model_through_the_trainer_resumes_bit_exactly(tmp_path):
    from jdp.config import load_config
    from jdp.train import train

    config = load_config(None, ["train.steps=4", "train.log_every=1", "data.batch_size=16", "optim.lr=0.05",
                                "parallel.devices=4"])

    def run(workdir, stop_after=None):
        task = jdp.nnx.task(DropoutNet(rngs=nnx.Rngs(0)), loss_fn, metric_fn, data(64), data(20, seed=1),
                            has_aux=True)
        return train(config, str(workdir), progress=False, log=lambda *_: None, stop_after=stop_after, task=task)

    whole = run(tmp_path / "whole")
    assert run(tmp_path / "split", stop_after=2).steps == 2
    resumed = run(tmp_path / "split")
    assert resumed.resumed_from == 2 and resumed.eval == whole.eval and "accuracy" in whole.eval
    for a, b in zip(jax.tree.leaves(whole.params), jax.tree.leaves(resumed.params)):
        np.testing.assert_array_equal(a, b)
    losses = [[r["loss"] for r in jdp.run.metrics.load_metrics(str(d)) if "loss" in r] for d in (tmp_path / "whole",
                                                                                             tmp_path / "split")]
    assert losses[0] == losses[1] and len(losses[0]) == 4


def test_axis_name_names_the_axis_batchnorm_and_the_loss_reduce_over():
    """axis_name='batch': jdp binds that axis, sets it on its copy's BatchNorms, and a loss that pmeans
    over 'batch' (as Flax's examples write their metrics) runs; the step equals the default axis's."""
    from jax import lax

    def batch_loss(model, batch):  # a metric reduced over the axis, as Flax's examples write it
        loss, aux = loss_fn(model, batch)
        return loss, {"accuracy": lax.pmean(aux["accuracy"], "batch")}

    batch, results = data(16, seed=2), []
    for fn, options in ((loss_fn, {}), (batch_loss, {"axis_name": "batch"})):
        step = jdp.nnx.make_train_step(Tiny(rngs=nnx.Rngs(0)), fn, optax.sgd(0.1), has_aux=True,
                                       devices=jax.devices()[:4], **options)
        state = step.init(seed=0)
        for _ in range(2):
            state, metrics = step(state, batch)
        results.append((jdp.get_params(state), jdp.step.get_tree(state, state.model_state), metrics["aux"]))
    for a, b in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1])):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="reduces over the mesh axis 'batch' .* binds 'data'"):
        step = jdp.nnx.make_train_step(Tiny(rngs=nnx.Rngs(0)), batch_loss, optax.sgd(0.1), has_aux=True,
                                       devices=jax.devices()[:4])
        step(step.init(seed=0), batch)
