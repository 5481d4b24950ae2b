"""Two parts of benchmarks/gpu_check.sh that compile before (or instead of) running, each in a process
of its own: `python -m benchmarks.gpu_check_parts PART PLAN RESULT.json SECONDS`.

  fit      the largest global batch that fits one device, found from XLA's memory analysis of the
           compiled step (nothing runs while it searches, so nothing can run out of memory), then
           one timed run at that batch: remat on (the config's), then the search alone with remat off
  layouts  replicated / ZeRO-1 / FSDP / jdp's jit backend compiled for 8 fake CPU devices in a CPU
           process (JAX_PLATFORMS=cpu): bytes per device and the compiled collectives. A mocked GPU
           topology cannot sit beside a real GPU, and one GPU has no NCCL peers: the CPU compiler
           builds the same sharded program (its collectives, not the GPU's scheduling).

Like benchmarks.gpu_parts, a part writes what it has after every measurement, so a part stopped
at its time limit still leaves its first numbers. SECONDS is the part's time limit: the search
starts no compile it cannot finish, keeping time for the timed run.
"""
from __future__ import annotations

import json
import os
import sys
import time

from benchmarks.gpu_parts import Plan, plan_named

MARGIN = 0.9  # of the device's memory limit: the allocator's fragmentation and the runtime's own buffers
LAYOUTS = {"replicated": {}, "zero1": {"shard_optimizer_state": True}, "fsdp": {"shard_params": True},
           "jit": {"backend": "jit", "shard_params": True}}  # jit: jdp's global-view backend under FSDP


def fit_sizes(plan: Plan) -> dict:
    """The search's first two probes (global batches), the step between candidates, the most compiles,
    the timed run's steps, and the remat settings searched (a rehearsal: the first only, same code)."""
    if plan.name == "dry":
        return {"probes": (2, 4), "quantum": 2, "steps": 1, "max_compiles": 8, "remat": (True,)}
    return {"probes": (64, 128), "quantum": 8, "steps": 3, "max_compiles": 7, "remat": (True, False)}


def compiled_bytes(stats) -> int:
    """Bytes one device needs for a compiled program: XLA's peak where it reports one, else
    arguments + outputs - donated (aliased) + temporaries."""
    total = (stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
             + stats.temp_size_in_bytes)
    return int(max(getattr(stats, "peak_memory_in_bytes", 0) or 0, total))


def next_probe(probes: dict, limit: float, quantum: int) -> int | None:
    """The next global batch to compile, from `probes` {batch: bytes}: where the line through two
    probes crosses `limit` (memory is ~ fixed + per-window × batch), through the two largest until
    one is too large, then through the largest that fits and the smallest that does not (the middle
    where the line points outside them); None once those two are `quantum` (or 3%) apart."""
    fits = sorted(b for b, m in probes.items() if m <= limit)
    over = sorted(b for b, m in probes.items() if m > limit)
    if over and fits and over[0] - fits[-1] <= max(quantum, fits[-1] // 32):
        return None
    b0, b1 = (fits[-1], over[0]) if over and fits else sorted(probes)[-2:] if not over else (0, over[0])
    m0, m1 = probes.get(b0, 0), probes[b1]
    per = max((m1 - m0) / (b1 - b0), 1.0)
    guess = int(b0 + (limit - m0) / per) // quantum * quantum
    if not over:  # nothing known too large: the line's guess, or 25% past the largest that fits
        return guess if guess > b1 else b1 + max(quantum, b1 // 4 // quantum * quantum)
    lo = fits[-1] if fits else 0
    mid = (lo + over[0]) // 2 // quantum * quantum
    return guess if lo < guess < over[0] else (mid if lo < mid < over[0] else None)


def search(compile_at, limit_of, sizes: dict, deadline: float, reserve: float, on_probe) -> int | None:
    """The largest global batch whose compiled step needs at most `limit_of(probes)` bytes;
    `compile_at(batch)` -> (bytes, seconds). Starts no compile that would pass `deadline` - `reserve`."""
    probes, slowest = {}, 0.0
    queue = list(sizes["probes"])
    while len(probes) < sizes["max_compiles"]:
        batch = queue.pop(0) if queue else next_probe(probes, limit_of(probes), sizes["quantum"])
        if batch is None or batch in probes or time.perf_counter() + slowest * 1.5 > deadline - reserve:
            break
        probes[batch], seconds = compile_at(batch)
        slowest = max(slowest, seconds)
        on_probe(batch, probes[batch], seconds)
    return max((b for b, m in probes.items() if m <= limit_of(probes)), default=None)


def limit_of(device):
    """probes -> (bytes the search may fill, how that was chosen): MARGIN × the device's memory limit;
    a CPU reports none, so a rehearsal pretends its device holds 3× its largest probe so far
    once two are known (enough to make the search step past them)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        limit = MARGIN * stats["bytes_limit"]
        return lambda probes: (limit, f"{MARGIN:.0%} of the device's bytes_limit {stats['bytes_limit']:,}")
    said = "no device limit (CPU): 3x the bytes of the second probe (a rehearsal)"
    return lambda probes: (3.0 * sorted(probes.values())[1] if len(probes) > 1 else float("inf"), said)


def _timed(step, state, placed, flops: int, batch: int, context: int, steps: int, device) -> dict:
    """One timed run at `batch`: step time, tokens/s, and MFU from `flops`, the model's FLOPs per step
    (nanoGPT's 6N + 12·L·H·Q·T per token, `benchmarks.gpu.gpt_step_flops`): a GPU's compiled cost analysis
    leaves out the cuBLAS matmuls and cuDNN attention, which are custom calls there."""
    from benchmarks.gpu import mfu, peak_flops_for, peak_memory_bytes, time_steps

    res = time_steps(step, state, placed, steps, 1)
    return {**res, "steps": steps, "tokens_per_s": batch * context / res["median_step_s"], "flops_per_step": flops,
            "flops_source": "gpt: 6N+12LHQT",
            "mfu": mfu(flops, res["median_step_s"], peak_flops_for(device.device_kind), 1),
            "peak_memory_bytes": peak_memory_bytes(device)}


def part_fit(plan: Plan, emit, seconds: float) -> None:
    """(c) For remat on and then off: search the batch on compiled memory; time remat on at its batch."""
    import jax
    import numpy as np
    import optax

    import jdp
    from benchmarks.gpu import gpt_model, gpt_step_flops

    deadline = time.perf_counter() + seconds
    sizes, device, out = fit_sizes(plan), jax.devices()[0], {}
    context, vocab, limit = plan.gpt["context"], plan.gpt["vocab"], limit_of(jax.devices()[0])
    rng = np.random.default_rng(0)
    for remat in sizes["remat"]:
        params, loss_fn = gpt_model(**plan.gpt, precision="bfloat16", attention="fused", remat=remat)
        step = jdp.make_train_step(loss_fn, optax.adamw(3e-4, weight_decay=0.1), precision="bfloat16", audit=False)
        state, compiled = step.init(params), {}
        row = out[f"remat {'on' if remat else 'off'}"] = {"context": context, "probes": []}

        def batches(b, k=1, step=step):
            tokens = rng.integers(0, vocab, (k, b, context + 1)).astype(np.int32)
            return [step.shard_batch({"x": t[:, :-1], "y": t[:, 1:]}) for t in tokens]

        def compile_at(b, step=step, state=state, compiled=compiled, batches=batches):
            t0 = time.perf_counter()
            compiled[b] = step.lower(state, batches(b)[0]).compile()
            return compiled_bytes(compiled[b].memory_analysis()), time.perf_counter() - t0

        def on_probe(b, need, s, row=row):
            row["probes"].append({"batch": b, "bytes": need, "compile_s": round(s, 1)})
            emit(out)

        reserve = 45.0 if remat and plan.name != "dry" else 0.0  # the timed run: a compile, then its steps
        best = search(compile_at, lambda p: limit(p)[0], sizes, deadline, reserve, on_probe)
        probes = {p["batch"]: p["bytes"] for p in row["probes"]}
        row.update(global_batch=best, limit_bytes=limit(probes)[0], limit=limit(probes)[1])
        emit(out)
        if remat and best:
            flops = gpt_step_flops(params, n_layers=plan.gpt["n_layers"], d_model=plan.gpt["d_model"],
                                   context=context, global_batch=best)
            row["timed"] = _timed(step, state, batches(best, 2), flops, best, context, sizes["steps"], device)
            emit(out)
        del state, step, compiled  # remat off's search needs the device memory back


def part_layouts(plan: Plan, emit, seconds: float) -> None:
    """(e) The plan's GPT (bf16 compute, AdamW) compiled for N fake CPU devices in each of LAYOUTS, from
    abstract values (nothing is placed or run): XLA's bytes per device and the compiled collectives."""
    import jdp.cpu

    n = 8 if plan.name != "dry" else 2
    jdp.cpu.use_cpu_devices(n)
    import jax

    from benchmarks.gpu_parts import compiled_layouts

    out = {"backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()[:n]], "runs": {str(n): {}}}
    for layout in LAYOUTS:
        try:
            out["runs"][str(n)].update(compiled_layouts(plan, n, jax.devices(), {layout: LAYOUTS[layout]}))
        except Exception as e:  # noqa: BLE001 - one layout's failure is its row; the others still compile
            out["runs"][str(n)][layout] = {"error": f"{type(e).__name__}: {e}"[:300]}
        emit(out)


PARTS = {"fit": part_fit, "layouts": part_layouts}


def main(argv) -> int:
    part, plan_name, result_path, seconds = argv

    def emit(result: dict) -> None:
        tmp = result_path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1, default=str)
        os.replace(tmp, result_path)  # the reader never sees half a file

    PARTS[part](plan_named(plan_name), emit, float(seconds))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
