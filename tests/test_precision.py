"""Mixed precision in the step: bf16 compute on float32 masters, and bf16 gradient communication."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jdp
from jdp.inspect.comm import parse_collectives
from tests.helpers import batches, mlp_loss, mlp_params

GLOBAL = 32


def run(n, *, optimizer=None, steps=5, backend="shard_map", **options):
    step = jdp.make_train_step(mlp_loss, optimizer or optax.sgd(0.5), devices=jax.devices()[:n], backend=backend,
                               **options)
    state = step.init(mlp_params())
    for batch in batches(steps, GLOBAL):
        state, metrics = step(state, batch)
    return jdp.get_params(state), state, metrics


def movement(params):
    """Each leaf's change from the initial params."""
    return jax.tree.map(lambda p, p0: p - p0, params, mlp_params())


def max_diff(a, b) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


# bf16 keeps 8 bits of mantissa: one rounding is up to 2^-8 relative. Splitting the batch over N
# devices changes where the backward pass's bf16 sums round, so N devices equal one device to a few
# of those roundings of the update, not to float32's 1e-6.
BF16_REL = 2e-2


@pytest.mark.parametrize("n,backend,accum", [(2, "shard_map", 1), (4, "pmap", 1), (8, "shard_map", 1),
                                             (4, "shard_map", 2)])
def test_bf16_step_on_n_devices_equals_bf16_on_one(n, backend, accum):
    options = dict(accum_steps=accum, accum_sync="last")
    one, _, _ = run(1, precision="bf16", **options)
    many, state, metrics = run(n, backend=backend, precision="bf16", **options)
    fp32, _, _ = run(1, **options)
    scale = max(float(np.abs(x).max()) for x in jax.tree.leaves(movement(fp32)))
    assert max_diff(many, one) <= BF16_REL * scale
    # bf16 really ran: it moved the params differently from float32 by far more than float32 rounding ...
    assert max_diff(one, fp32) > 1e-4 * scale
    # ... and no further than bf16 rounding allows.
    assert max_diff(one, fp32) <= 5 * BF16_REL * scale
    # the masters, the optimizer state and the metrics stay float32
    assert {str(x.dtype) for x in jax.tree.leaves((state.params, state.opt_state))} <= {"float32", "int32"}
    assert metrics["loss"].dtype == jnp.float32 and metrics["grad_norm"].dtype == jnp.float32


def test_bf16_compute_is_in_the_program_and_fp32_is_not():
    texts = {}
    for precision in ("float32", "bfloat16"):
        step = jdp.make_train_step(mlp_loss, optax.sgd(0.1), devices=jax.devices()[:2], precision=precision)
        state = step.init(mlp_params())
        texts[precision] = step.lower(state, batches(1, GLOBAL)[0]).as_text()
    assert "bf16" not in texts["float32"]
    assert len([line for line in texts["bfloat16"].splitlines() if "dot_general" in line and "bf16" in line]) >= 3


def lowered_allreduce_bytes(step, state, batch) -> int:
    """All-reduce bytes of the program as jdp writes it, before the backend's passes."""
    return sum(c["bytes"] for c in parse_collectives(step.lower(state, batch).as_text(dialect="hlo"))
               if c["kind"] == "all-reduce")


@pytest.mark.parametrize("accum_sync", ["every", "last"])
def test_bf16_reduce_dtype_halves_the_allreduce_bytes(accum_sync):
    batch, sizes = batches(1, GLOBAL)[0], {}
    grad_bytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves(mlp_params()))
    for reduce_dtype in (None, "bfloat16"):
        step = jdp.make_train_step(mlp_loss, optax.adam(1e-2), devices=jax.devices()[:4], precision="bf16",
                                   reduce_dtype=reduce_dtype, accum_steps=2, accum_sync=accum_sync)
        state = step.init(mlp_params())
        sizes[reduce_dtype] = lowered_allreduce_bytes(step, state, batch)
        report = jdp.comm_report(step, state, batch)
        assert report.gradient_bytes == (grad_bytes if reduce_dtype is None else grad_bytes // 2)
        assert report.gradient_allreduces_per_update == (2 if accum_sync == "every" else 1)
        # This CPU backend's collectives have no bf16: XLA widens the all-reduce back to f32, and says so.
        assert any(c.widened for c in report.allreduces) == (reduce_dtype is not None)
    scalars = 64  # loss, example count and the like travel in float32 beside the gradient
    assert sizes[None] >= grad_bytes
    assert abs(sizes["bfloat16"] - sizes[None] / 2) <= scalars


def test_bf16_reduce_dtype_costs_bf16_rounding_and_keeps_float32_state():
    exact, _, _ = run(8, optimizer=optax.adam(1e-2))
    sent, state, _ = run(8, optimizer=optax.adam(1e-2), reduce_dtype="bf16")
    assert 0 < max_diff(sent, exact) <= BF16_REL * 5e-2  # Adam moves each weight by about lr per step
    assert {str(x.dtype) for x in jax.tree.leaves(state.opt_state)} <= {"float32", "int32"}


def test_bf16_mean_divides_before_it_sums():
    # Each device's gradient is 2e38: bf16 and float32 both top out at 3.4e38, so eight of them
    # summed overflow to inf; divided by 8 first, the mean is 2e38 and finite.
    def loss(params, batch):
        return jnp.mean(batch["x"]) * params["w"] * 2e38

    step = jdp.make_train_step(loss, optax.sgd(1e-37), reduce_dtype="bf16", grad_norm=False)
    state, _ = step(step.init({"w": np.float32(1.0)}), {"x": np.ones((8, 1), np.float32)})
    assert np.isfinite(jdp.get_params(state)["w"])
    np.testing.assert_allclose(jdp.get_params(state)["w"], 1.0 - 20.0, rtol=1e-2)


def test_model_state_and_mask_stay_float32():
    def loss(params, stats, batch):
        h = batch["x"] @ params["w"]
        assert batch["mask"].dtype == jnp.float32  # a count of examples, never rounded to bf16
        new_stats = 0.9 * stats + 0.1 * jnp.mean(h)
        return jnp.sum(batch["mask"] * jnp.mean(h ** 2, axis=1)) / h.shape[0], new_stats

    step = jdp.make_train_step(loss, optax.sgd(0.1), has_state=True, precision="bf16", devices=jax.devices()[:2],
                               mask_key="mask", sync_batchnorm=False)  # per-device running mean
    state = step.init({"w": np.ones((3, 2), np.float32)}, np.float32(0.0))
    batch = {"x": np.ones((4, 3), np.float32), "mask": np.array([1, 1, 1, 0], np.float32)}
    state, metrics = step(state, batch)
    assert state.model_state.dtype == jnp.float32 and metrics["loss"].dtype == jnp.float32


def test_nnx_step_takes_the_precision_option():
    model = nnx.Sequential(nnx.Linear(12, 16, rngs=nnx.Rngs(0)), nnx.relu, nnx.Linear(16, 5, rngs=nnx.Rngs(1)))

    def loss_fn(model, batch):
        logits = model(batch["x"]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    step = jdp.nnx.make_train_step(model, loss_fn, optax.sgd(0.1), precision="bf16", reduce_dtype="bf16",
                                   devices=jax.devices()[:2])
    state = step.init()
    assert "bf16" in step.step.lower(state, step.step.shard_batch(batches(1, 8)[0])).as_text()
    state, metrics = step(state, batches(1, 8)[0])
    assert np.isfinite(float(metrics["loss"]))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.params))


@pytest.mark.parametrize("option,value,message", [
    ("precision", "fp16", r"precision='fp16' is not supported \(float16 needs loss scaling"),
    ("precision", jnp.float16, r"precision=float16 is not supported \(float16 needs loss scaling"),
    ("precision", "int8", r"precision='int8' is not supported; use 'float32' \('fp32'\) or 'bfloat16'"),
    ("reduce_dtype", "float64", r"reduce_dtype='float64' is not supported; use None, 'float32'"),
])
def test_bad_dtypes_are_refused_in_one_sentence(option, value, message):
    with pytest.raises(ValueError, match=message):
        jdp.make_train_step(mlp_loss, optax.sgd(0.1), **{option: value})


def test_bf16_master_params_are_refused():
    step = jdp.make_train_step(mlp_loss, optax.sgd(0.1), precision="bf16")
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), mlp_params())
    with pytest.raises(ValueError, match=r"params\['l0'\]\['b'\] is bfloat16; precision='bfloat16' keeps float32 "
                                         r"master params"):
        step.init(params)
