"""Part "zero" of `python -m benchmarks.run`: the optimizer state sharded (ZeRO-1) vs replicated.

Throughput: the benchmark MLP with Adam, replicated and sharded steps timed in interleaved windows
on this process's devices. Memory: bytes per device of params, gradient and optimizer state for
N = 1, 2, 4, 8, read from the states' shards (`jdp.memory_report`) in a fresh process with 8 fake
CPU devices:

  python -m benchmarks.zero memory      # prints one RESULT line (JSON)
"""
from __future__ import annotations

import json
import sys

from benchmarks.common import (GLOBAL_BATCH, fresh_process_result, mlp_batches, mlp_params, paired_ratio, param_count,
                               time_layouts)

MEMORY_DEVICES = (1, 2, 4, 8)


def _loss(params, batch):
    import jax.numpy as jnp
    import optax

    h = batch["x"]
    for i, (w, b) in enumerate(params):
        h = h @ w + b
        if i < len(params) - 1:
            h = jnp.maximum(h, 0)
    return optax.softmax_cross_entropy_with_integer_labels(h, batch["y"]).mean()


def bench_zero(sizes, steps: int, repeats: int, log=print) -> dict:
    """Step time of the replicated and the sharded layout (Adam), interleaved, and their ratio."""
    import jax
    import optax

    import jdp

    layouts = {name: jdp.make_train_step(_loss, optax.adam(1e-3), shard_optimizer_state=shard, grad_norm=False)
               for name, shard in (("replicated", False), ("sharded", True))}
    out, times = time_layouts(layouts, sizes, repeats, steps, log, "zero")
    out.update({"mlp": list(sizes), "params": param_count(sizes), "devices": jax.device_count(),
                "global_batch": GLOBAL_BATCH})
    out["ratio_sharded_over_replicated"] = paired_ratio(times["sharded"], times["replicated"])
    out["memory"] = memory_table(sizes, log)
    return out


def memory_table(sizes, log=print) -> dict:
    """`memory_rows` for N = 1, 2, 4, 8 in a fresh process with 8 fake CPU devices."""
    rows = fresh_process_result("benchmarks.zero", "memory", ",".join(map(str, sizes)), timeout=600)
    if isinstance(rows, dict):  # {"error": ...}
        return rows
    for row in rows:
        log(f"    N={row['devices']} {row['layout']}: params {row['params']:,} B, gradient {row['gradient']:,} B, "
            f"optimizer state {row['optimizer_state']:,} B per device")
    return {"rows": rows, "formula": "Adam in float32, P params: replicated 16·P "
            "(params 4, gradient 4, moments 8); optimizer state sharded (4 + 4 + 8/N)·P, plus padding"}


def memory_rows(sizes) -> list[dict]:
    """Bytes per device for Adam on the MLP `sizes`, replicated and sharded, N = 1, 2, 4, 8."""
    import jax
    import optax

    import jdp

    rows = []
    for n in MEMORY_DEVICES:
        for layout, shard in (("replicated", False), ("sharded", True)):
            if shard and n == 1:
                continue
            step = jdp.make_train_step(_loss, optax.adam(1e-3), devices=jax.devices()[:n], shard_optimizer_state=shard)
            state = step.init(mlp_params(sizes))
            report = jdp.memory_report(step, state, mlp_batches(sizes, 1, global_batch=8 * n)[0])
            rows.append({"devices": n, "layout": layout, "params": report.params, "gradient": report.gradient,
                         "reduced_gradient": report.reduced_gradient, "optimizer_state": report.optimizer_state,
                         "compiled": report.compiled,
                         "bytes_per_param": (report.params + report.gradient + report.optimizer_state)
                         / param_count(sizes)})
    return rows


if __name__ == "__main__":
    if sys.argv[1:2] != ["memory"] or len(sys.argv) != 3:
        sys.exit("usage: python -m benchmarks.zero memory 784,1024,1024,10")
    import jdp.cpu

    jdp.cpu.use_cpu_devices(8)
    print("RESULT " + json.dumps(memory_rows(tuple(int(s) for s in sys.argv[2].split(",")))))
