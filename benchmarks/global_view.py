"""The per-device view (`backend="shard_map"`) and the global view (`backend="jit"`) side by side.

On the same model in each layout (replicated, ZeRO-1, FSDP), on 8 fake CPU devices, per device:
the compiled step's allocation (`jdp.memory_report(...).allocated`: arguments + outputs not aliased
to donated arguments + temporaries), its collectives (`jdp.comm_report`: how many of each kind and
their bytes per optimizer step), the step time as a ratio jit / shard_map (the two timed in
interleaved windows in this one process, the median of the per-round ratios), and the largest
|Δparam| between the two after a few steps from the same start. Two models: jdp's benchmark MLP
on digits-sized inputs (64 → 128 → 10, Adam) and a small `jdp.models.GPT` (Adam).

  python -m benchmarks.global_view            # writes benchmarks/results/global_view.md
  python -m benchmarks.global_view --quick --out FILE.md   # tiny sizes, few rounds (a smoke test)
"""
from __future__ import annotations

import argparse
import os
import time

from benchmarks.common import ROOT, calls_timer, interleave, median, mlp_loss, mlp_params, paired_ratio

RESULTS = os.path.join(ROOT, "benchmarks", "results", "global_view.md")
DEVICES = 8
LAYOUTS = {"replicated": {}, "zero1": {"shard_optimizer_state": True}, "fsdp": {"shard_params": True}}
BACKENDS = ("shard_map", "jit")
MLP = (64, 128, 10)  # digits: 8x8 images, 10 classes
GPT = dict(vocab=65, context=32, d_model=64, n_heads=4, n_layers=2, per_device=4)
QUICK_GPT = dict(vocab=65, context=8, d_model=16, n_heads=2, n_layers=1, per_device=1)


def _mlp(backend: str, layout: str, per_device: int, devices=None):
    """(step, initial state, two placed global batches) for the MLP, on `devices` (default all)."""
    import numpy as np
    import optax

    import jdp

    step = jdp.make_train_step(mlp_loss, optax.adam(1e-3), backend=backend, grad_norm=False, devices=devices,
                               **LAYOUTS[layout])
    rng = np.random.default_rng(1)
    batches = [{"x": rng.normal(size=(per_device * DEVICES, MLP[0])).astype(np.float32),
                "y": rng.integers(0, MLP[-1], per_device * DEVICES).astype(np.int32)} for _ in range(2)]
    return step, step.init(mlp_params(MLP)), [step.shard_batch(b) for b in batches]


def _gpt(backend: str, layout: str, g: dict, devices=None):
    """(step, initial state, two placed global batches) for the GPT (no dropout: both views draw
    the same keys, but a model without it shows the layouts' arithmetic alone)."""
    import numpy as np
    import optax
    from flax import nnx

    import jdp
    from jdp.models import GPT as Model

    def loss_fn(model, batch):
        logits = model(batch["x"], train=False)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    model = Model(g["vocab"], g["context"], d_model=g["d_model"], n_heads=g["n_heads"], n_layers=g["n_layers"],
                  dropout=0.0, rngs=nnx.Rngs(0))
    step = jdp.nnx.make_train_step(model, loss_fn, optax.adam(1e-3), backend=backend, grad_norm=False,
                                   devices=devices, **LAYOUTS[layout])
    rng = np.random.default_rng(2)
    tokens = [rng.integers(0, g["vocab"], (g["per_device"] * DEVICES, g["context"] + 1)).astype(np.int32)
              for _ in range(2)]
    return step, step.init(), [step.shard_batch({"x": t[:, :-1], "y": t[:, 1:]}) for t in tokens]


def _kinds(report) -> str:
    counts = {}
    for c in report.collectives:
        counts[c.kind] = counts.get(c.kind, 0) + c.executions_per_update
    return ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items())) or "none"


def _trained(step, state, placed, steps: int):
    """(the params on the host, the state) after `steps` steps on the two batches in turn."""
    import jax

    import jdp

    for i in range(steps):
        state, _ = step(state, placed[i % 2])
    return jax.device_get(jdp.get_params(state)), state


def _max_diff(a, b) -> float:
    import jax
    import numpy as np

    return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def compare(model: str, build, layout: str, steps: int, repeats: int, timed: int, reference, log=print) -> dict:
    """One model in one layout under both backends: memory, collectives, |Δparam| between them and
    against `reference` (one device's params after the same steps), and the time ratio."""
    import jdp

    row, runners, params = {"model": model, "layout": layout}, {}, {}
    for backend in BACKENDS:
        step, state, placed = build(backend, layout)
        memory, comm = jdp.memory_report(step, state, placed[0]), jdp.comm_report(step, state, placed[0])
        row[backend] = {"allocated": memory.allocated, "state": memory.state, "collectives": _kinds(comm),
                        "collective_bytes": comm.bytes_per_update}
        params[backend], state = _trained(step, state, placed, steps)  # the same batches from the same start
        row[backend]["vs_one_device"] = _max_diff(params[backend], reference)
        runners[backend] = calls_timer(step, state, placed)
        runners[backend](1)
    row["max_abs_dparam"] = _max_diff(params["jit"], params["shard_map"])
    times = interleave(runners, timed, repeats, log=lambda *a, **k: None)
    row["ratio_jit_over_shard_map"] = paired_ratio(times["jit"], times["shard_map"])
    row["median_ms"] = {b: median(times[b]) * 1e3 for b in BACKENDS}
    log(f"  {model} {layout}: jit/shard_map {row['ratio_jit_over_shard_map']:.2f}, "
        f"max |Δparam| {row['max_abs_dparam']:.1e}")
    return row


def measure(quick: bool = False, log=print) -> dict:
    """Every (model, layout) row. Needs `DEVICES` CPU devices (`jdp.cpu.use_cpu_devices`)."""
    g = QUICK_GPT if quick else GPT
    models = {"MLP 64-128-10": lambda backend, layout, devices=None: _mlp(backend, layout, 2 if quick else 16, devices),
              f"GPT {g['n_layers']}x{g['d_model']}": lambda backend, layout, devices=None: _gpt(backend, layout, g,
                                                                                                 devices)}
    steps, repeats, timed = (2, 2, 1) if quick else (3, 9, 5)
    import jax

    rows = []
    for name, build in models.items():
        reference, _ = _trained(*build("shard_map", "replicated", jax.devices()[:1]), steps)
        rows += [compare(name, build, layout, steps, repeats, timed, reference, log) for layout in LAYOUTS]
    return {"rows": rows, "gpt": g, "quick": quick, "steps": steps, "repeats": repeats, "timed": timed}


def markdown(result: dict, seconds: float) -> str:
    """The side-by-side table, with how and when it was measured."""
    g, load = result["gpt"], os.getloadavg()[0]
    out = [f"`python -m benchmarks.global_view{' --quick' if result['quick'] else ''}`, "
           f"{time.strftime('%Y-%m-%d')}, {DEVICES} fake CPU devices on {os.cpu_count()} CPU cores, {seconds:.0f} s. "
           f"The machine was shared with other work (load average {load:.0f} when the table was written), "
           f"so only the ratios of step times are quoted, each the median of {result['repeats']} rounds in which "
           f"the two steps ran {result['timed']} steps each, back to back, in a new order each round.", "",
           f"Models: jdp's benchmark MLP 64 → 128 → 10 (digits-sized inputs, 16 examples per device) and "
           f"`jdp.models.GPT` ({g['n_layers']} layers, d_model {g['d_model']}, context {g['context']}, "
           f"{g['per_device']} sequences per device, no dropout), both with Adam in float32. Bytes are per "
           f"device: \"allocates\" is `jdp.memory_report(...).allocated` (XLA's analysis of the compiled step); "
           f"collectives and their bytes are `jdp.comm_report`'s, per optimizer step. |Δparam| is the largest "
           f"difference between the two backends' params after {result['steps']} steps from the same start; "
           f"\"vs 1 device\" is each backend's against one device's step on the whole batch (Adam's first steps divide each gradient "
           f"element by its own size, so float32 rounding in elements near zero shows in both).", "",
           "| model | layout | allocates B (shard_map) | allocates B (jit) | collectives (shard_map) | "
           "collectives (jit) | collective B (shard_map) | collective B (jit) | time jit / shard_map | "
           "max \\|Δparam\\| | vs 1 device (shard_map, jit) |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        s, j = r["shard_map"], r["jit"]
        out.append(f"| {r['model']} | {r['layout']} | {s['allocated']:,} | {j['allocated']:,} | {s['collectives']} | "
                   f"{j['collectives']} | {s['collective_bytes']:,} | {j['collective_bytes']:,} | "
                   f"{r['ratio_jit_over_shard_map']:.2f} | {r['max_abs_dparam']:.1e} | "
                   f"{s['vs_one_device']:.1e}, {j['vs_one_device']:.1e} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.global_view", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes and few rounds (a smoke test)")
    parser.add_argument("--out", default=RESULTS, help=f"the Markdown file to write (default {RESULTS})")
    args = parser.parse_args(argv)
    import jdp.cpu

    jdp.cpu.use_cpu_devices(DEVICES)
    t0 = time.perf_counter()
    result = measure(args.quick)
    text = "# Per device or global view, measured\n\n" + markdown(result, time.perf_counter() - t0)
    with open(args.out, "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
