"""GPU mode of `python -m benchmarks.run` (jax.default_backend() == "gpu"): a GPT trained with bf16
compute and fp32 master weights, the largest global batch that fits, and MFU.

UNTESTED ON A GPU: written without one. On CPU the arithmetic (`mfu`, `peak_flops_for`), the
batch search (`largest_fitting`) and the bf16 step itself (`gpt_benchmark` on a tiny GPT, with
peak unknown) are exercised by tests/test_benchmarks.py.

Mixed precision here: the params (master weights), gradients, all-reduce and Adam state are
fp32; the loss casts a bf16 copy of the params and computes the forward and backward in bf16,
the logits back in fp32 for the cross-entropy.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from jdp.metrics import peak_flops as peak_flops_for  # jdp train's table (PEAK_FLOPS), so both MFUs agree


def mfu(flops_per_step: float, step_seconds: float, peak_per_device: float | None, devices: int) -> float | None:
    """Model FLOPs utilisation: achieved FLOP/s ÷ (peak FLOP/s per device × devices).

    `flops_per_step` counts all devices together (XLA's per-device cost analysis × devices).
    """
    if not peak_per_device or step_seconds <= 0 or devices < 1:
        return None
    return flops_per_step / step_seconds / (peak_per_device * devices)


def is_oom(err: BaseException) -> bool:
    text = f"{type(err).__name__}: {err}"
    return "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text


def largest_fitting(candidates: Sequence[int], attempt: Callable[[int], dict]) -> tuple[int, dict, list[int]]:
    """Try `attempt(batch)` for decreasing batch sizes; return (batch, its result, sizes that OOMed).

    An out-of-memory error moves on to the next smaller size; any other error is raised.
    """
    failed = []
    for batch in sorted(candidates, reverse=True):
        try:
            return batch, attempt(batch), failed
        except Exception as e:  # noqa: BLE001 - only OOM is swallowed
            if not is_oom(e):
                raise
            failed.append(batch)
    raise RuntimeError(f"no batch size fits: every one of {sorted(candidates, reverse=True)} ran out of memory.")


def gpt_benchmark(*, d_model: int = 768, n_layers: int = 12, n_heads: int = 12, context: int = 512,
                  vocab: int = 256, batch_candidates: Sequence[int] = (512, 256, 128, 64, 32, 16),
                  steps: int = 20, repeats: int = 3, log=print) -> dict:
    """Train-step throughput and MFU of jdp's step on a bf16-compute GPT over all devices."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import jdp
    from jdp.metrics import step_flops
    from jdp.models import GPT, functional

    devices = jax.devices()
    n = len(devices)
    fm = functional(GPT(vocab, context, d_model=d_model, n_heads=n_heads, n_layers=n_layers, dropout=0.0,
                        rngs=nnx.Rngs(0)))
    params32 = jax.tree.map(lambda x: np.asarray(x, np.float32), fm.params)
    n_params = int(sum(np.size(x) for x in jax.tree.leaves(params32)))

    def loss_fn(params, batch):
        p16 = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)  # fp32 master -> bf16 compute copy
        logits = fm.apply(p16, batch["x"], train=False).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    rng = np.random.default_rng(0)

    def attempt(global_batch: int) -> dict:
        if global_batch % n:
            raise ValueError(f"batch {global_batch} does not divide over {n} devices")
        step = jdp.make_train_step(loss_fn, optax.adamw(3e-4, weight_decay=0.1))
        tokens = rng.integers(0, vocab, (2, global_batch, context + 1)).astype(np.int32)
        placed = [step.shard_batch({"x": t[:, :-1], "y": t[:, 1:]}) for t in tokens]
        state = step.init(params32)
        t0 = time.perf_counter()
        state, m = step(state, placed[0])
        jax.block_until_ready(state)
        first = time.perf_counter() - t0
        flops = step_flops(step, state, placed[0])
        per_step = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for i in range(steps):
                state, m = step(state, placed[i % 2])
            jax.block_until_ready(state)
            per_step.append((time.perf_counter() - t0) / steps)
        return {"first_call_s": first, "median_step_s": float(np.median(per_step)), "flops_per_step": flops,
                "final_loss": float(m["loss"])}

    batch, res, oomed = largest_fitting(list(batch_candidates), attempt)
    peak = peak_flops_for(devices[0].device_kind)
    out = {"model": {"d_model": d_model, "n_layers": n_layers, "n_heads": n_heads, "context": context,
                     "vocab": vocab, "params": n_params},
           "precision": "bf16 compute, fp32 master weights/grads/all-reduce/Adam state",
           "devices": n, "device_kind": devices[0].device_kind, "global_batch": batch, "oom_batches": oomed,
           "tokens_per_s": batch * context / res["median_step_s"], "peak_flops_per_device": peak,
           "mfu": mfu(res["flops_per_step"] or 0.0, res["median_step_s"], peak, n), **res}
    log(f"  GPT {n_params:,} params, batch {batch} (OOM at {oomed or 'none'}): {res['median_step_s'] * 1e3:.1f} ms/step, "
        f"{out['tokens_per_s']:,.0f} tokens/s, MFU {out['mfu']}")
    return out
