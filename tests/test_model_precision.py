"""The models' compute dtype (float32 params, bf16 compute, float32 logits), the GPT's fused attention and remat."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jdp
from jdp.models import CNN, GPT, MLP, functional
from jdp.models.dtypes import compute_dtype

X = np.random.default_rng(0).normal(size=(8, 64)).astype(np.float32)  # 8 digits-shaped inputs
TOKENS = np.random.default_rng(1).integers(0, 40, (4, 16)).astype(np.int32)
KEY = jax.random.key(5)


def make(name, dtype=None, **kw):
    """A tiny model of each kind; the same seed gives the same float32 params whatever the dtype."""
    if name == "mlp":
        return MLP([64, 32, 10], dtype=dtype, rngs=nnx.Rngs(0))
    if name == "cnn":
        return CNN(10, (4, 8), dtype=dtype, rngs=nnx.Rngs(0))
    return GPT(40, 16, 32, 2, 2, kw.pop("dropout", 0.1), dtype=dtype, rngs=nnx.Rngs(0), **kw)


def forward(fm, name, tokens=TOKENS, key=KEY):
    """params -> float logits, in train mode (batch statistics, dropout from `key`)."""
    if name == "gpt":
        return lambda params: fm.apply(params, tokens, train=True, rngs=key)
    return lambda params: fm.apply(params, X, train=True)


def dtypes_of(tree):
    return {str(x.dtype) for x in jax.tree.leaves(tree)}


def eqns(jaxpr):
    """Every equation of `jaxpr`, including those of the jaxprs nested in its equations (jit, remat, ...)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr holds its Jaxpr in .jaxpr
                if hasattr(inner, "eqns"):
                    yield from eqns(inner)


def matmul_operand_dtypes(f, *args):
    """The dtypes of the operands of every dot_general / conv in f's jaxpr."""
    jaxpr = jax.make_jaxpr(f)(*args).jaxpr
    return {str(v.aval.dtype) for e in eqns(jaxpr) if e.primitive.name in ("dot_general", "conv_general_dilated")
            for v in e.invars}


def loss_and_grads(fm, tokens, key):
    def loss(params):
        logits = fm.apply(params, tokens[:, :-1], train=True, rngs=key)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    return jax.jit(jax.value_and_grad(loss))(fm.params)


def max_diff(a, b):
    return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.parametrize("value", [jnp.float16, "fp16", "float16", "int8", 3])
def test_bad_dtype_is_a_one_sentence_error_naming_it(value):
    for name in ("mlp", "cnn", "gpt"):
        with pytest.raises(ValueError, match=r"float16|fp16|int8|3") as info:
            make(name, dtype=value)
        message = str(info.value)
        assert repr(value) in message and "bfloat16" in message and message.count(". ") == 0


def test_bad_attention_is_a_one_sentence_error_and_dtype_spellings_are_accepted():
    with pytest.raises(ValueError, match=r"attention='flash' is not one of \('flax', 'fused', 'cudnn'\)\.$"):
        make("gpt", attention="flash")
    # cuDNN flash attention exists on GPUs only, in bf16: anywhere else, one sentence instead of a trace error
    with pytest.raises(ValueError, match=r"attention='cudnn' \(cuDNN flash attention\) needs a GPU and dtype "
                                         r"bfloat16; here jax runs on 'cpu' with dtype bfloat16: use 'fused'\.$"):
        make("gpt", attention="cudnn", dtype="bf16")
    for value in (None, jnp.float32, "float32", "fp32", np.float32):
        assert compute_dtype(value) == jnp.float32
    for value in (jnp.bfloat16, "bfloat16", "bf16", jnp.dtype(jnp.bfloat16)):
        assert compute_dtype(value) == jnp.bfloat16


@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt"])
def test_bf16_compute_with_float32_params_logits_and_gradients(name):
    fp32, bf16 = functional(make(name)), functional(make(name, dtype="bf16"))
    assert dtypes_of(bf16.params) == {"float32"} and dtypes_of(bf16.rest) <= {"float32"}
    assert max_diff(fp32.params, bf16.params) == 0  # the same float32 params: dtype changes only the compute
    ref = jax.jit(forward(fp32, name))(fp32.params)

    def loss_and_logits(params):
        logits = forward(bf16, name)(params)
        return jnp.mean(logits ** 2), logits

    # One compiled call for the bf16 logits and the gradient of a loss on them w.r.t. the float32 params.
    grads, out = jax.jit(jax.grad(loss_and_logits, has_aux=True))(fp32.params)
    assert ref.dtype == out.dtype == jnp.float32
    rel = float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref)))
    assert 1e-4 < rel < 5e-2, rel  # rounded like bf16 (~3 significant digits), but the same function
    assert dtypes_of(grads) == {"float32"} and jax.tree.structure(grads) == jax.tree.structure(bf16.params)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
    # Every matmul / conv reads bf16 operands in the bf16 model, and only float32 ones in the default model.
    assert matmul_operand_dtypes(forward(bf16, name), bf16.params) == {"bfloat16"}
    assert matmul_operand_dtypes(forward(fp32, name), fp32.params) == {"float32"}


def test_cnn_bf16_train_call_keeps_batch_stats_float32():
    fp32, bf16 = functional(make("cnn")), functional(make("cnn", dtype="bf16"))
    train_call = jax.jit(lambda rest: bf16.apply_with_state(bf16.params, rest, X, train=True)[1])
    ref, stats = fp32.apply_with_state(fp32.params, fp32.rest, X, train=True)[1], train_call(bf16.rest)
    assert dtypes_of(bf16.rest) == dtypes_of(stats) == {"float32"}
    assert jax.tree.structure(stats) == jax.tree.structure(bf16.rest)
    moved = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(stats), jax.tree.leaves(bf16.rest)))
    close = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(stats), jax.tree.leaves(ref)))
    assert moved > 1e-3 and close < 1e-2 * moved  # updated, from float32 statistics of bf16 activations
    again = train_call(stats)  # a second call from the state the first one wrote
    assert dtypes_of(again) == {"float32"}


def test_fused_attention_equals_flax_attention():
    plain, fused = functional(make("gpt", dropout=0.3)), functional(make("gpt", dropout=0.3, attention="fused"))
    # The same params in the same structure: the option changes the attention function, not the weights.
    assert jax.tree.structure(fused.params) == jax.tree.structure(plain.params)
    assert max_diff(fused.params, plain.params) == 0
    ref = jax.jit(lambda p: plain.apply(p, TOKENS, train=False))(plain.params)  # eval, T = context
    out = jax.jit(lambda p: fused.apply(p, TOKENS, train=False))(plain.params)
    assert out.shape == (4, 16, 40) and max_diff(out, ref) <= 1e-5
    # Train mode (dropout on) on a shorter sequence: is_causal on a T < context input.
    ref_loss, ref_grads = loss_and_grads(plain, TOKENS[:, :10], KEY)
    loss, grads = loss_and_grads(fused, TOKENS[:, :10], KEY)
    assert abs(float(loss - ref_loss)) <= 1e-5 and max_diff(grads, ref_grads) <= 1e-5


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_remat_equals_no_remat(dropout):
    plain, remat = functional(make("gpt", dropout=dropout)), functional(make("gpt", dropout=dropout, remat=True))
    assert jax.tree.structure(remat.params) == jax.tree.structure(plain.params)
    # T = 9 as in the test above, whose identical reference computation the compilation cache then holds.
    ref_loss, ref_grads = loss_and_grads(plain, TOKENS[:, :10], KEY)
    loss, grads = loss_and_grads(remat, TOKENS[:, :10], KEY)  # the same dropout masks: keys drawn in the same order
    assert abs(float(loss - ref_loss)) <= 1e-6 and max_diff(grads, ref_grads) <= 1e-6
    assert max_diff(ref_grads, jax.tree.map(jnp.zeros_like, ref_grads)) > 1e-3  # not trivially equal


def test_remat_is_in_the_jaxpr_and_fused_attention_builds_no_mask():
    remat_names = {"checkpoint", "remat", "remat2"}  # jax.checkpoint's primitive, by jax version
    fm = functional(make("gpt", remat=True))
    top = [e.primitive.name for e in jax.make_jaxpr(forward(fm, "gpt"))(fm.params).jaxpr.eqns]
    assert len([n for n in top if n in remat_names]) == 2  # one per block

    def shapes_and_names(fm):
        found = list(eqns(jax.make_jaxpr(forward(fm, "gpt"))(fm.params).jaxpr))
        return {tuple(v.aval.shape) for e in found for v in e.outvars}, {e.primitive.name for e in found}

    mask_shape = (4, 1, 16, 16)  # nnx.make_causal_mask(tokens): (batch, 1, T, T)
    shapes, names = shapes_and_names(functional(make("gpt")))
    assert mask_shape in shapes and not remat_names & names
    # bf16 + fused + remat together: no materialised (batch, 1, T, T) mask, still only bf16 matmuls.
    both = functional(make("gpt", dtype="bf16", attention="fused", remat=True))
    assert mask_shape not in shapes_and_names(both)[0]
    assert matmul_operand_dtypes(forward(both, "gpt"), both.params) == {"bfloat16"}


def train_gpt(fm, steps=2, n=2):
    """Two SGD steps through jdp's data-parallel step on n devices, dropout keys from the step's seed."""
    def loss_fn(params, batch, rng):
        logits = fm.apply(params, batch["x"], train=True, rngs=rng)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    step = jdp.make_train_step(loss_fn, optax.sgd(0.5), devices=jax.devices()[:n], needs_rng=True)
    state = step.init(fm.params, seed=3)
    for i in range(steps):
        tokens = np.roll(np.concatenate([TOKENS, TOKENS]), i, axis=1)
        state, metrics = step(state, {"x": tokens[:, :-1], "y": tokens[:, 1:]})
    return jdp.get_params(state), float(metrics["loss"])


def test_options_train_through_jdps_step():
    ref_start = functional(make("gpt", dropout=0.3))
    ref_params, ref_loss = train_gpt(ref_start)
    start = functional(make("gpt", dropout=0.3, dtype="bf16", attention="fused", remat=True))
    params, loss = train_gpt(start)
    # The same training up to bf16 rounding (float32 equality of each option is tested above).
    assert dtypes_of(params) == {"float32"} and abs(loss - ref_loss) < 5e-2 * abs(ref_loss)
    assert max_diff(params, ref_params) < 0.1 * max_diff(ref_params, ref_start.params)
