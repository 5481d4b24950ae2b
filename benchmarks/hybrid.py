"""Hybrid sharding (`replicas=R`) against FSDP over every device: what crosses between hosts, the
state per device, and the step time, for the benchmark MLP with Adam on 8 fake CPU devices taken as
2 hosts of 4 (hybrid: one replica group per host).

  python -m benchmarks.hybrid      # prints the table and writes benchmarks/results/hybrid.md

Traffic is read from each compiled step (`jdp.comm_report`): the ring bytes each device sends per
optimizer step in collectives whose devices lie on one host (hybrid's reduce-scatter and
all-gather within a group) and in collectives that span both hosts (every collective of FSDP over
8 devices; hybrid's all-reduce of the blocks between the groups, and the small all-reduce of the
loss and metrics). Fake CPU devices share one memory, so these are the program's bytes, not a
link's measured bandwidth. Step times are interleaved windows in one process; their ratio is
what to compare.
"""
from __future__ import annotations

import json
import os
import sys

from benchmarks.common import BIG_MLP, ROOT, paired_ratio, param_count, time_layouts
from benchmarks.zero import _loss

RESULTS = os.path.join(ROOT, "benchmarks", "results", "hybrid.md")
DEVICES, HOST = 8, 4  # 2 hosts of 4 devices
LAYOUTS = {"replicated": {}, "fsdp": {"shard_params": True}, "hybrid": {"shard_params": True, "replicas": 2}}


def traffic(step, state, batch) -> dict:
    """Ring bytes per device per optimizer step, within one host and spanning hosts, and the state's bytes."""
    import jdp

    report = jdp.comm_report(step, state, batch)
    within = sum(c.ring_bytes(step.num_devices) * c.executions_per_update for c in report.collectives
                 if c.group is not None and c.group == HOST and step.options.replicas == DEVICES // HOST)
    return {"within_host": within, "between_hosts": report.ring_bytes_per_device - within,
            "state": jdp.memory_report(step, state).state, "collectives": str(report)}


def bench_hybrid(steps: int = 10, repeats: int = 9, log=print) -> dict:
    import jax
    import optax

    import jdp
    from benchmarks.common import mlp_batches, mlp_params

    layouts = {name: jdp.make_train_step(_loss, optax.adam(1e-3), grad_norm=False, devices=jax.devices()[:DEVICES],
                                         **options) for name, options in LAYOUTS.items()}
    out = {"mlp": list(BIG_MLP), "params": param_count(BIG_MLP), "devices": DEVICES, "host": HOST}
    for name, step in layouts.items():
        out[name] = traffic(step, step.init(mlp_params(BIG_MLP)), step.shard_batch(mlp_batches(BIG_MLP, 1)[0]))
    timed, times = time_layouts(layouts, BIG_MLP, repeats, steps, log, "hybrid")
    for name in layouts:
        out[name]["ms_per_step"] = timed[name]["median_step_s"] * 1e3
    out["ratio_hybrid_over_fsdp"] = paired_ratio(times["hybrid"], times["fsdp"])
    out["ratio_hybrid_over_replicated"] = paired_ratio(times["hybrid"], times["replicated"])
    return out


def markdown(r: dict) -> str:
    mb = lambda x: f"{x / 1e6:,.2f} MB"  # noqa: E731
    rows = [f"`python -m benchmarks.hybrid`: MLP {'-'.join(map(str, r['mlp']))} ({r['params']:,} params), Adam, "
            f"{r['devices']} fake CPU devices taken as {r['devices'] // r['host']} hosts of {r['host']}; bytes each "
            f"device sends per optimizer step (ring), state kept per device, median step time.", "",
            "| layout | within a host | between hosts | state per device | ms/step |", "|---|---|---|---|---|"]
    names = {"replicated": "replicated (all-reduce over 8)", "fsdp": "FSDP over all 8 devices",
             "hybrid": "hybrid, `replicas=2` (FSDP within each host)"}
    for key, name in names.items():
        x = r[key]
        rows.append(f"| {name} | {mb(x['within_host'])} | {mb(x['between_hosts'])} | {mb(x['state'])} | "
                    f"{x['ms_per_step']:.1f} |")
    rows += ["", f"Step time, paired rounds: hybrid / FSDP {r['ratio_hybrid_over_fsdp']:.3f}, hybrid / replicated "
                 f"{r['ratio_hybrid_over_replicated']:.3f}."]
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    import jdp.cpu

    jdp.cpu.use_cpu_devices(DEVICES)
    result = bench_hybrid(log=lambda *a: print(*a, file=sys.stderr))
    text = markdown(result)
    with open(RESULTS, "w", encoding="utf-8") as f:
        f.write(text)
    with open(RESULTS.replace(".md", ".json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    print(text)
