"""Part "fsdp" of `python -m benchmarks.run`: params, gradient and optimizer state sharded (FSDP)
vs the optimizer state sharded (ZeRO-1) vs replicated.

Step time: the benchmark MLP with Adam, the three layouts timed in interleaved windows on this
process's devices (2 fake CPU devices in `benchmarks.run`); the ratio replicated / FSDP should be
≥ 0.77 (FSDP ≤ 1.3× the replicated step). Memory: an 8-layer `jdp.models.GPT` with Adam, for
N = 1, 2, 4, 8 and remat off and on, from `jdp.memory_report` (the state's shards, and XLA's
analysis of the compiled step), in a fresh process with 8 fake CPU devices:

  python -m benchmarks.fsdp memory [--quick]   # prints one RESULT line (JSON)
  python -m benchmarks.fsdp table              # both parts; writes benchmarks/results/fsdp.md
"""
from __future__ import annotations

import json
import os
import sys
import time

from benchmarks.common import GLOBAL_BATCH, ROOT, fresh_process_result, paired_ratio, param_count, time_layouts
from benchmarks.zero import _loss

RESULTS = os.path.join(ROOT, "benchmarks", "results", "fsdp.md")
LAYOUTS = {"replicated": {}, "zero1": {"shard_optimizer_state": True}, "fsdp": {"shard_params": True}}
# The memory table's GPT: 8 layers of width 128 (1.6 M params), 4 sequences of 64 characters per device.
GPT = dict(vocab=65, context=64, d_model=128, n_heads=4, n_layers=8, per_device=4)
QUICK_GPT = dict(vocab=65, context=16, d_model=32, n_heads=2, n_layers=2, per_device=2)


def bench_fsdp(sizes, steps: int, repeats: int, log=print, quick: bool = False) -> dict:
    """Step time of the three layouts (Adam), interleaved, their ratios, comm reports and the memory table."""
    import jax
    import optax

    import jdp

    layouts = {name: jdp.make_train_step(_loss, optax.adam(1e-3), grad_norm=False, **options)
               for name, options in LAYOUTS.items()}
    out, times = time_layouts(layouts, sizes, repeats, steps, log, "fsdp")
    out.update({"mlp": list(sizes), "params": param_count(sizes), "devices": jax.device_count(),
                "global_batch": GLOBAL_BATCH})
    out["ratio_fsdp_over_replicated"] = paired_ratio(times["fsdp"], times["replicated"])
    out["ratio_replicated_over_fsdp"] = paired_ratio(times["replicated"], times["fsdp"])
    out["ratio_zero1_over_replicated"] = paired_ratio(times["zero1"], times["replicated"])
    out["memory"] = memory_table(quick, log)
    return out


def memory_table(quick: bool, log=print) -> dict:
    """`memory_rows` in a fresh process with 8 fake CPU devices."""
    result = fresh_process_result("benchmarks.fsdp", "memory", *(["--quick"] if quick else []), timeout=1800)
    if "error" in result:
        return result
    for row in result["rows"]:
        log(f"    remat={row['remat']} N={row['devices']} {row['layout']}: state {row['state']:,} B, "
            f"step allocates {row['allocated']:,} B per device")
    return result


def _gpt_step(g: dict, n: int, layout: str, remat: bool):
    import jax
    import optax
    from flax import nnx

    import jdp
    from jdp.models import GPT

    def loss_fn(model, batch):
        logits = model(batch["x"], train=False)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    model = GPT(g["vocab"], g["context"], d_model=g["d_model"], n_heads=g["n_heads"], n_layers=g["n_layers"],
                dropout=0.0, remat=remat, rngs=nnx.Rngs(0))
    return jdp.nnx.make_train_step(model, loss_fn, optax.adam(1e-3), devices=jax.devices()[:n], grad_norm=False,
                                   **LAYOUTS[layout])


def memory_rows(quick: bool = False) -> dict:
    """Bytes per device for Adam on the GPT: state between steps and the compiled step's allocation."""
    import jax
    import numpy as np

    import jdp

    g = QUICK_GPT if quick else GPT
    rng = np.random.default_rng(0)
    rows, count = [], None
    for remat in ((False,) if quick else (False, True)):
        for n in ((1, 2) if quick else (1, 2, 4, 8)):
            for layout in LAYOUTS:
                if n == 1 and layout != "replicated":
                    continue
                step = _gpt_step(g, n, layout, remat)
                state = step.init()
                count = count or int(sum(np.size(x) for x in jax.tree.leaves(jdp.get_params(state))))
                tokens = rng.integers(0, g["vocab"], (g["per_device"] * n, g["context"] + 1)).astype(np.int32)
                report = jdp.memory_report(step, state, {"x": tokens[:, :-1], "y": tokens[:, 1:]})
                rows.append({"remat": remat, "devices": n, "layout": layout, "params": report.params,
                             "optimizer_state": report.optimizer_state, "state": report.state,
                             "state_bytes_per_param": report.state / count, **report.compiled,
                             "allocated": report.allocated, "allocated_bytes_per_param": report.allocated / count})
    return {"model": g, "param_count": count, "rows": rows}


def markdown(timing: dict | None, memory: dict) -> str:
    """The memory table (and, if measured, the step times) as Markdown."""
    g, count = memory["model"], memory["param_count"]
    out = [f"GPT: {g['n_layers']} layers, d_model {g['d_model']}, {g['n_heads']} heads, context {g['context']}, "
           f"{count:,} params, Adam in float32, {g['per_device']} sequences per device. Bytes per device; "
           f"\"state\" is what the step keeps between calls (params + optimizer state), \"step allocates\" "
           f"is XLA's memory analysis of the compiled step: arguments + outputs not aliased to donated "
           f"arguments + temporaries (gradient, gathered params, activations).", "",
           "| remat | N | layout | params B | optimizer state B | state B/param | temporaries B | "
           "step allocates B | B/param |", "|---|---|---|---|---|---|---|---|---|"]
    for r in memory["rows"]:
        out.append(f"| {'on' if r['remat'] else 'off'} | {r['devices']} | {r['layout']} | {r['params']:,} | "
                   f"{r['optimizer_state']:,} | {r['state_bytes_per_param']:.2f} | {r['temp']:,} | "
                   f"{r['allocated']:,} | {r['allocated_bytes_per_param']:.2f} |")
    if timing:
        out += ["", f"Step time, MLP {'-'.join(map(str, timing['mlp']))} ({timing['params']:,} params), Adam, "
                f"{timing['devices']} fake CPU devices, global batch {timing['global_batch']}:", "",
                "| layout | median ms/step | samples/s | / replicated (paired rounds) |", "|---|---|---|---|"]
        ratio = {"replicated": 1.0, "zero1": timing["ratio_zero1_over_replicated"],
                 "fsdp": timing["ratio_fsdp_over_replicated"]}
        for name in LAYOUTS:
            out.append(f"| {name} | {timing[name]['median_step_s'] * 1e3:.1f} | {timing[name]['samples_per_s']:,.0f} "
                       f"| {ratio[name]:.3f} |")
    return "\n".join(out) + "\n"


def write_table() -> str:
    """Both parts on this machine (the step times on 2 fake CPU devices); benchmarks/results/fsdp.md."""
    import jdp.cpu

    jdp.cpu.use_cpu_devices(2)
    from benchmarks.common import BIG_MLP

    t0 = time.perf_counter()
    timing = bench_fsdp(BIG_MLP, steps=10, repeats=15)
    memory = timing.pop("memory")
    if "rows" not in memory:
        raise SystemExit(f"memory table failed: {memory.get('error')}")
    text = (f"# FSDP vs ZeRO-1 vs replicated, measured\n\n`python -m benchmarks.fsdp table` on "
            f"{os.cpu_count()} CPU cores, {time.strftime('%Y-%m-%d')}, {time.perf_counter() - t0:.0f} s.\n\n"
            + markdown(timing, memory))
    with open(RESULTS, "w") as f:
        f.write(text)
    with open(RESULTS.replace(".md", ".json"), "w") as f:
        json.dump({"timing": timing, "memory": memory}, f, indent=1)
    return text


if __name__ == "__main__":
    if sys.argv[1:2] == ["memory"]:
        import jdp.cpu

        jdp.cpu.use_cpu_devices(8)
        print("RESULT " + json.dumps(memory_rows(quick="--quick" in sys.argv[2:])))
    elif sys.argv[1:] == ["table"]:
        print(write_table())
    else:
        sys.exit("usage: python -m benchmarks.fsdp memory [--quick] | table")
