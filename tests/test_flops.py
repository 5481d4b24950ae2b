"""Model FLOPs (jdp.inspect.flops): jdp's GPT by nanoGPT's formula, other models from the traced program,
never remat's recomputation; the peak table MFU divides by. Traces only: nothing here compiles."""
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jdp.inspect.flops import (GPT_SOURCE, PROGRAM_SOURCE, gpt_flops_per_token, jaxpr_flops, program_forward_flops,
                               program_model_flops)
from jdp.models import CNN, GPT, MLP, functional
from jdp.run.config import load_config
from jdp.run.metrics import flops_line, peak_flops, step_model_flops
from jdp.run.tasks import build_task, train_step_for

D, HEADS, LAYERS, T = 32, 4, 2, 16
TINY_GPT = ["model.name=gpt", "data.name=chars", f"model.d_model={D}", f"model.n_heads={HEADS}",
            f"model.n_layers={LAYERS}", f"model.context={T}", "data.batch_size=16"]


def _forward(fm):
    return lambda params, x: fm.apply_with_state(params, fm.rest, x, train=False)[0]


def test_the_gpts_count_is_nanogpts_formula_exactly():
    """6N + 12·L·H·Q·T per token, N every param but the position embedding, counted by hand here."""
    task = build_task(load_config(None, TINY_GPT))
    vocab = task.params["tok_embed"]["embedding"].shape[0]
    block = (4 * D * D + 4 * D) + 2 * (2 * D) + (D * 4 * D + 4 * D) + (4 * D * D + D)  # attn, 2 LNs, fc, proj
    n = vocab * D + LAYERS * block + 2 * D + D * vocab  # token embedding, blocks, final LN, head
    assert gpt_flops_per_token(n, LAYERS, D, T) == 6 * n + 12 * LAYERS * D * T
    assert (task.flops_per_example, task.flops_source) == ((6 * n + 12 * LAYERS * D * T) * T, GPT_SOURCE)
    flops = step_model_flops(task, None, None, 16)  # the task's own count: neither step nor batch is read
    assert (flops.per_step, flops.source) == ((6 * n + 12 * LAYERS * D * T) * T * 16, GPT_SOURCE)


@pytest.mark.parametrize("scan", [False, True])
def test_remat_is_never_counted_as_model_flops(scan):
    """The same GPT with and without remat: the same model FLOPs from its program (the backward program
    of the remat one holds a second forward pass: hardware FLOPs, not model FLOPs)."""
    tokens = jax.ShapeDtypeStruct((3, T), jnp.int32)
    counts = {}
    for remat in (False, True):
        fm = functional(GPT(50, T, d_model=D, n_heads=HEADS, n_layers=LAYERS, dropout=0.0, remat=remat,
                            scan_layers=scan, rngs=nnx.Rngs(0)))
        counts[remat] = program_model_flops(_forward(fm), fm.params, tokens)
        grad = jax.grad(lambda p, x, fm=fm: _forward(fm)(p, x).sum())
        forward, differentiated = (program_forward_flops(f, fm.params, tokens) for f in (_forward(fm), grad))
        assert (differentiated > 3 * forward if remat else differentiated == 3 * forward), (remat, scan)
    assert counts[True] == counts[False] and counts[True].source == PROGRAM_SOURCE
    # the program's count is the formula's but for what is no matmul: the token lookup, biases and norms
    n_matmul = LAYERS * 12 * D * D + D * 50
    assert counts[False].per_step == 3 * 3 * T * (2 * n_matmul + 4 * LAYERS * D * T)


def test_plain_models_count_from_the_program_as_their_analytic_count():
    """An MLP through the trainer's path (8 devices × 2 accumulation steps: one device's share traced, then
    scaled) and a CNN: 3 × forward multiply-adds × 2 of their layers."""
    config = load_config(None, ["model.hidden=[32,16]", "data.batch_size=64", "parallel.accum_steps=2"])
    task = build_task(config)
    step = train_step_for(config, task, jax.devices())
    first = {"x": np.zeros((64, 64), np.float32), "y": np.zeros(64, np.int32)}
    flops = step_model_flops(task, step, step.micro_batches(first)[0], 64)
    assert flops.source == PROGRAM_SOURCE
    np.testing.assert_allclose(flops.per_step, 6 * (64 * 32 + 32 * 16 + 16 * 10) * 64, rtol=0.02)
    mlp = functional(MLP([64, 32, 10], rngs=nnx.Rngs(0)))
    assert program_model_flops(_forward(mlp), mlp.params, jax.ShapeDtypeStruct((5, 64), jnp.float32)).per_step \
        == 6 * (64 * 32 + 32 * 10) * 5
    cnn = functional(CNN(10, (16, 32), rngs=nnx.Rngs(0)))
    macs = 9 * 1 * 16 * 64 + 9 * 16 * 32 * 16 + 512 * 10  # 3×3 convs on 8×8, then (pooled) 4×4; the head
    counted = program_model_flops(_forward(cnn), cnn.params, jax.ShapeDtypeStruct((4, 8, 8, 1), jnp.float32))
    np.testing.assert_allclose(counted.per_step, 6 * macs * 4, rtol=0.02)


def test_cudnn_attention_counts_as_the_xla_attentions_matmuls():
    """cuDNN's attention call (a GPU-only primitive, shown to the counter by its name and shapes) counts
    what jax's XLA attention's two matmuls count for the same shapes, in both layouts."""
    b, t, s, heads, h = 2, 8, 8, 4, 16
    q, k = jax.ShapeDtypeStruct((b, t, heads, h), jnp.bfloat16), jax.ShapeDtypeStruct((b, s, heads, h), jnp.bfloat16)
    xla = program_forward_flops(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True), q, k, k)
    for shapes, layout in ((((b, t, heads, h), (b, s, heads, h)), 0), (((b, heads, t, h), (b, heads, s, h)), 1)):
        eqn = SimpleNamespace(primitive=SimpleNamespace(name="dot_product_attention_fwd_wrapper"),
                              invars=[SimpleNamespace(aval=SimpleNamespace(shape=x)) for x in shapes],
                              params={"layout": layout})
        assert jaxpr_flops(SimpleNamespace(eqns=[eqn])) == xla == 4 * b * t * s * heads * h


def test_the_peak_table_knows_devices_and_dtypes_and_says_when_it_does_not():
    assert peak_flops("NVIDIA H200") == peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA H200", "float32") == 494.5e12 and peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("cpu") is None and peak_flops("NVIDIA H200", "float16") is None
    assert flops_line(None, None, "Some GPU", "bfloat16") == (
        "model FLOPs: none (the loss could not be traced on its own); no MFU: jdp has no peak FLOP/s for device "
        "kind 'Some GPU' in bfloat16")
    flops = SimpleNamespace(per_step=40.93e12, source=GPT_SOURCE)
    assert flops_line(flops, 989e12, "NVIDIA H200", "bfloat16") == (
        "model FLOPs per step: 40.930 TFLOP (gpt: 6N+12LHQT); MFU against 989.0 TFLOP/s bfloat16 per device "
        "(NVIDIA H200)")
