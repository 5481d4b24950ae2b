"""GPU mode of `python -m benchmarks.run` (jax.default_backend() == "gpu") and of
benchmarks/gpu_check.sh: jdp's step on `jdp.models.GPT` in float32 or bfloat16, the largest global
batch that fits, and MFU.

UNTESTED ON A GPU: written without one. On CPU the arithmetic (`mfu`, `peak_flops_for`), the
batch search (`largest_fitting`) and the step itself (`gpt_benchmark` on a tiny GPT, with peak
unknown) are exercised by tests/test_benchmarks.py.

Mixed precision here is the library's: `make_train_step(precision="bfloat16")` runs the loss on a
bf16 copy of the float32 master params, and `GPT(dtype=jnp.bfloat16)` computes its layers in bf16
and returns float32 logits for the cross-entropy; gradients, their all-reduce and the AdamW state
stay float32 (jdp/core/precision.py has the table). Attention is "fused" (`jax.nn.dot_product_attention`,
XLA's implementation) unless `attention="cudnn"` (cuDNN's flash attention) is asked for, and `remat=True`
recomputes each block in the backward pass. MFU counts the model's FLOPs (nanoGPT's 6N + 12·L·H·Q·T per
token, `gpt_step_flops`), never XLA's cost analysis of the compiled step.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from jdp.run.metrics import peak_flops as peak_flops_for  # jdp train's table (PEAK_FLOPS), so both MFUs agree


def mfu(flops_per_step: float, step_seconds: float, peak_per_device: float | None, devices: int) -> float | None:
    """Model FLOPs utilisation: achieved FLOP/s ÷ (peak FLOP/s per device × devices).

    `flops_per_step` counts all devices together: the model's FLOPs (`gpt_step_flops`), never XLA's cost
    analysis of the compiled step, which on a GPU leaves out cuBLAS GEMMs and cuDNN attention.
    """
    if not peak_per_device or step_seconds <= 0 or devices < 1:
        return None
    return flops_per_step / step_seconds / (peak_per_device * devices)


def gpt_step_flops(params, *, n_layers: int, d_model: int, context: int, global_batch: int) -> int:
    """Model FLOPs of one training step of jdp's GPT over `global_batch` windows of `context` tokens:
    nanoGPT's 6N + 12·L·H·Q·T per token (`jdp.inspect.flops.gpt_flops_per_token`), N every param of
    `params` but the position embedding. Counted from the model, so the same with or without remat."""
    from jdp.inspect.flops import gpt_flops_per_token, gpt_params_without_position

    n = gpt_params_without_position(params)
    return gpt_flops_per_token(n, n_layers, d_model, context) * global_batch * context


def is_oom(err: BaseException) -> bool:
    text = f"{type(err).__name__}: {err}"
    return "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text


def largest_fitting(candidates: Sequence[int], attempt: Callable[[int], dict],
                    on_try: Callable[[int, str, float], object] | None = None) -> tuple[int, dict, list[int]]:
    """Try `attempt(batch)` for decreasing batch sizes; return (batch, its result, sizes that OOMed).

    An out-of-memory error moves on to the next smaller size; any other error is raised.
    `on_try(batch, "fits" | "out of memory", seconds)` hears of each try as it ends.
    """
    failed = []
    tell = on_try or (lambda *a: None)
    for batch in sorted(candidates, reverse=True):
        t0 = time.perf_counter()
        try:
            result = attempt(batch)
        except Exception as e:  # noqa: BLE001 - only OOM is swallowed
            if not is_oom(e):
                raise
            failed.append(batch)
            tell(batch, "out of memory", time.perf_counter() - t0)
            continue
        tell(batch, "fits", time.perf_counter() - t0)
        return batch, result, failed
    raise RuntimeError(f"no batch size fits: every one of {sorted(candidates, reverse=True)} ran out of memory.")


def gpt_model(*, vocab: int, context: int, d_model: int, n_heads: int, n_layers: int, precision: str,
              attention: str = "fused", remat: bool = False):
    """jdp's GPT as (float32 params pytree, loss_fn(params, batch) -> mean cross-entropy).

    batch: {"x": int32 (B, T) tokens, "y": int32 (B, T) next tokens}; dropout 0 (a throughput
    workload), compute dtype bf16 when `precision` is "bfloat16", logits float32 either way.
    """
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from jdp.models import GPT, functional

    dtype = jnp.bfloat16 if precision in ("bfloat16", "bf16") else None
    fm = functional(GPT(vocab, context, d_model=d_model, n_heads=n_heads, n_layers=n_layers, dropout=0.0,
                        dtype=dtype, attention=attention, remat=remat, rngs=nnx.Rngs(0)))
    params = jax.tree.map(lambda x: np.asarray(x, np.float32), fm.params)

    def loss_fn(params, batch):
        logits = fm.apply(params, batch["x"], train=False)  # float32 (B, T, vocab)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    return params, loss_fn


def time_steps(step, state, batches, steps: int, repeats: int) -> dict:
    """First call (with any compilation not done before) and the median over `repeats` of the mean
    step time over `steps` calls, in seconds; the loss of the last call. `batches`: placed global
    batches, used in turn."""
    import jax

    t0 = time.perf_counter()
    state, m = step(state, batches[0])
    jax.block_until_ready(state)
    first = time.perf_counter() - t0
    per_step = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(steps):
            state, m = step(state, batches[i % len(batches)])
        jax.block_until_ready(state)
        per_step.append((time.perf_counter() - t0) / steps)
    return {"first_call_s": first, "median_step_s": float(np.median(per_step)), "final_loss": float(m["loss"])}


def peak_memory_bytes(device) -> int | None:
    """The device's peak bytes in use so far in this process (GPUs report it; CPUs give None)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None


def gpt_benchmark(*, d_model: int = 768, n_layers: int = 12, n_heads: int = 12, context: int = 512,
                  vocab: int = 256, batch_candidates: Sequence[int] = (512, 256, 128, 64, 32, 16),
                  steps: int = 20, repeats: int = 3, precision: str = "bfloat16", attention: str = "fused",
                  remat: bool = False, log=print, on_try=None) -> dict:
    """Train-step throughput and MFU of jdp's step (`precision=`) on `jdp.models.GPT` over all devices,
    at the largest of `batch_candidates` (global batches of `context`-token windows) that fits;
    `on_try` as in `largest_fitting`."""
    import jax
    import optax

    import jdp
    from jdp.inspect.flops import GPT_SOURCE

    devices = jax.devices()
    n = len(devices)
    params32, loss_fn = gpt_model(vocab=vocab, context=context, d_model=d_model, n_heads=n_heads,
                                  n_layers=n_layers, precision=precision, attention=attention, remat=remat)
    n_params = int(sum(np.size(x) for x in jax.tree.leaves(params32)))
    rng = np.random.default_rng(0)

    def attempt(global_batch: int) -> dict:
        if global_batch % n:
            raise ValueError(f"batch {global_batch} does not divide over {n} devices")
        step = jdp.make_train_step(loss_fn, optax.adamw(3e-4, weight_decay=0.1), precision=precision)
        tokens = rng.integers(0, vocab, (2, global_batch, context + 1)).astype(np.int32)
        placed = [step.shard_batch({"x": t[:, :-1], "y": t[:, 1:]}) for t in tokens]
        state = step.init(params32)
        t0 = time.perf_counter()
        step.lower(state, placed[0]).compile()  # the calls below reuse it
        compile_s = time.perf_counter() - t0
        flops = gpt_step_flops(params32, n_layers=n_layers, d_model=d_model, context=context, global_batch=global_batch)
        return {"compile_s": compile_s, **time_steps(step, state, placed, steps, repeats), "flops_per_step": flops,
                "flops_source": GPT_SOURCE}

    batch, res, oomed = largest_fitting(list(batch_candidates), attempt, on_try)
    peak = peak_flops_for(devices[0].device_kind)
    out = {"model": {"d_model": d_model, "n_layers": n_layers, "n_heads": n_heads, "context": context,
                     "vocab": vocab, "params": n_params, "attention": attention, "remat": remat},
           "precision": precision, "matmul_precision": str(jax.config.jax_default_matmul_precision),
           "devices": n, "device_kind": devices[0].device_kind, "global_batch": batch, "oom_batches": oomed,
           "tokens_per_s": batch * context / res["median_step_s"], "peak_flops_per_device": peak,
           "peak_memory_bytes": peak_memory_bytes(devices[0]),
           "mfu": mfu(res["flops_per_step"] or 0.0, res["median_step_s"], peak, n), **res}
    log(f"  GPT {n_params:,} params, {precision}, remat {remat}, batch {batch} (OOM at {oomed or 'none'}): "
        f"{res['median_step_s'] * 1e3:.1f} ms/step, {out['tokens_per_s']:,.0f} tokens/s, MFU {out['mfu']}")
    return out
