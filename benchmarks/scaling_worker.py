"""One device count of the scaling table, in a fresh process (the fake CPU device count is fixed
when jax starts): `python -m benchmarks.scaling_worker DEVICES STEPS REPEATS SIZES [SIZES ...]`,
SIZES like 784,1024,1024,10. Prints one line "RESULT <json>".

For each model size: jdp's shard_map step with Adam, fp32, global batch 256, batches pre-staged
with `step.shard_batch`; the time of the first call (compile + one step), the median step time
over REPEATS windows of STEPS steps (sizes interleaved), and the bytes one device holds for
params, gradients (same shapes and dtype as the params) and optimizer state.
"""
from __future__ import annotations

import json
import sys

import jdp.cpu

DEVICES = int(sys.argv[1])
jdp.cpu.use_cpu_devices(DEVICES)

import jax  # noqa: E402
import optax  # noqa: E402

import jdp  # noqa: E402
from benchmarks.common import (GLOBAL_BATCH, Timer, interleave, mlp_batches, mlp_loss, mlp_params,  # noqa: E402
                               param_count, summary, tree_bytes_per_device)


def main() -> int:
    steps, repeats = int(sys.argv[2]), int(sys.argv[3])
    all_sizes = [tuple(int(s) for s in arg.split(",")) for arg in sys.argv[4:]]
    rows, runners = {}, {}
    for sizes in all_sizes:
        name = "-".join(map(str, sizes))
        step = jdp.make_train_step(mlp_loss, optax.adam(1e-3))
        placed = [step.shard_batch(b) for b in mlp_batches(sizes, 4)]
        holder = {"state": step.init(mlp_params(sizes))}
        n_params = param_count(sizes)
        params_b = tree_bytes_per_device(holder["state"].params)
        opt_b = tree_bytes_per_device(holder["state"].opt_state)
        with Timer() as t:
            holder["state"], _ = step(holder["state"], placed[0])
            jax.block_until_ready(holder["state"])
        rows[name] = {"sizes": list(sizes), "params": n_params, "devices": DEVICES, "first_call_s": t.seconds,
                      "params_bytes_per_device": params_b, "grads_bytes_per_device": params_b,
                      "opt_state_bytes_per_device": opt_b,
                      "total_bytes_per_device": 2 * params_b + opt_b,
                      "bytes_per_param": (2 * params_b + opt_b) / n_params}

        def run(n, step=step, placed=placed, holder=holder):
            with Timer() as t:
                for i in range(n):
                    holder["state"], _ = step(holder["state"], placed[i % len(placed)])
                jax.block_until_ready(holder["state"])
            return t.seconds

        run(2)
        runners[name] = run
    times = interleave(runners, steps, repeats, log=lambda s: print(s, file=sys.stderr, flush=True))
    for name, per_step in times.items():
        rows[name].update(summary(per_step, GLOBAL_BATCH))
        rows[name]["compile_s_est"] = max(0.0, rows[name]["first_call_s"] - rows[name]["median_step_s"])
    print("RESULT " + json.dumps({"devices": DEVICES, "rows": list(rows.values())}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
