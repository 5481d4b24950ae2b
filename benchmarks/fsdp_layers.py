"""Part "fsdp_layers" of `python -m benchmarks.run`: the compiled step's peak per device for a GPT family at
three sizes on N = 8 fake CPU devices, per layout, and the slope in bytes per parameter.

Layouts, all on the same GPT with its layers scanned (`scan_layers=True`) and rematerialised, Adam
in float32, 4 sequences of 128 tokens per device:

- replicated, ZeRO-1 (`shard_optimizer_state`), FSDP gathering the whole model (`shard_params`);
- FSDP with the model gathering each layer inside its scan body (`gather_in_model=True`);
- the partitioner's FSDP: `jax.jit` with every params and optimizer leaf in a `NamedSharding`
  split as jdp splits it, the same scanned, rematerialised model, its residual stream pinned
  batch-sharded (`jax.lax.with_sharding_constraint(x, P("data"))` after the embedding and after each
  block, as MaxText and Levanter do); without the pin GSPMD carries the params' split into the
  activations and gathers far more (the row "partitioner_unpinned", kept to show it);
- jdp's `backend="jit"` with `shard_params=True` (a failure to build it is said in its row, and the
  other rows still run).

Each FSDP row also counts the compiled step's all-gathers, reduce-scatters and all-reduces and their bytes.

The peak is XLA's memory analysis of the compiled step: arguments + outputs − aliased + temporaries.
Each size is compiled (never run: the state is abstract) in a fresh process, with a timeout:

  python -m benchmarks.fsdp_layers memory SIZE   # one RESULT line (JSON) for one size
  python -m benchmarks.fsdp_layers time [SIZE [ROUNDS [STEPS]]]  # step-time ratios on the smallest size, one process
  python -m benchmarks.fsdp_layers table         # every size and the times; benchmarks/results/fsdp_layers.md
"""
from __future__ import annotations

import json
import os
import sys
import time

from benchmarks.common import ROOT, fresh_process_result, interleave, paired_ratio

RESULTS = os.path.join(ROOT, "benchmarks", "results", "fsdp_layers.md")
SIZES = {"2M": dict(d_model=192, n_layers=4), "8M": dict(d_model=384, n_layers=4),
         "32M": dict(d_model=768, n_layers=4)}
# `benchmarks.run --quick`: the same measurements on tiny models, to check the part runs (its numbers say little).
QUICK_SIZES = {"q1": dict(d_model=32, n_layers=2, context=32), "q2": dict(d_model=64, n_layers=2, context=32)}
COMMON = dict(vocab=256, context=128, n_heads=4, per_device=4)
LAYOUTS = {"replicated": {}, "zero1": {"shard_optimizer_state": True}, "fsdp_whole": {"shard_params": True},
           "fsdp_layers": {"shard_params": True, "gather_in_model": True}}
N = 8
# The partitioner's FSDP, with and without the residual stream pinned batch-sharded.
PARTITIONERS = {"partitioner": True, "partitioner_unpinned": False}
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce")


JIT = {"backend": "jit", "shard_params": True}  # jdp's global view under FSDP


def jdp_layouts() -> dict:
    """The layouts run through `jdp.make_train_step`: LAYOUTS and "jit"."""
    return {**LAYOUTS, "jit": JIT}


def _model(size: str, abstract: bool = True):
    from flax import nnx

    from jdp.models import GPT

    g = {**COMMON, **{**SIZES, **QUICK_SIZES}[size]}
    make = lambda: GPT(g["vocab"], g["context"], d_model=g["d_model"], n_heads=g["n_heads"],  # noqa: E731
                       n_layers=g["n_layers"], dropout=0.0, scan_layers=True, remat=True, rngs=nnx.Rngs(0))
    return (nnx.eval_shape(make) if abstract else make()), g


def pinned_logits(model, tokens, pin):
    """The scanned GPT's forward (`train=False`, dropout 0, attention "flax"), int32 (batch, T) → float32
    (batch, T, vocab) logits, with `pin` applied to the residual stream (batch, T, d_model) after the
    embedding and after each block. With `pin` the identity it is `model(tokens, train=False)`."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    x = pin(model.tok_embed(tokens) + model.pos_embed(jnp.arange(tokens.shape[1])))
    mask = nnx.make_causal_mask(tokens)
    graphdef, stack = nnx.split(model.layers)

    def body(x, layer):
        return pin(nnx.merge(graphdef, layer)(x, mask, train=False, rngs=None)), None

    x = jax.lax.scan(jax.checkpoint(body) if model.remat else body, x, stack)[0]
    return model.head(model.ln_f(x)).astype(jnp.float32)


def _loss(graphdef, rest, pin=None):
    """The mean cross-entropy of the GPT's next-token logits; with `pin`, through `pinned_logits`."""
    import optax
    from flax import nnx

    def loss(params, batch):
        model = nnx.merge(graphdef, params, rest, copy=True)
        logits = model(batch["x"], train=False) if pin is None else pinned_logits(model, batch["x"], pin)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    return loss


def _batch(g, n: int, abstract: bool):
    import jax
    import numpy as np

    shape = (g["per_device"] * n, g["context"])
    if abstract:
        return {k: jax.ShapeDtypeStruct(shape, np.int32) for k in ("x", "y")}
    rng = np.random.default_rng(0)
    return {k: rng.integers(0, g["vocab"], shape).astype(np.int32) for k in ("x", "y")}


def jdp_step(graphdef, rest, layout: str):
    import jax
    import optax

    import jdp

    return jdp.make_train_step(_loss(graphdef, rest), optax.adam(1e-3), devices=jax.devices()[:N], grad_norm=False,
                               **jdp_layouts()[layout])


def partitioner_step(graphdef, rest, params, pinned: bool = True):
    """`jax.jit` over global arrays: params and Adam's moments split as `jdp.zero.Cuts` splits them, the batch
    along its first axis; the partitioner inserts the gathers and reductions. `pinned`: the residual stream
    is constrained to the batch's split after the embedding and after each block."""
    import jax
    import optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from jdp.zero import Cuts

    mesh = Mesh(jax.devices()[:N], ("data",))
    pin = (lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P("data")))) if pinned else None
    tx, loss = optax.adam(1e-3), _loss(graphdef, rest, pin)
    shard = jax.tree.map(lambda s: NamedSharding(mesh, s), Cuts(params, N).specs(), is_leaf=lambda x: isinstance(x, P))
    opt_shard = optax.tree_map_params(tx, lambda _, s: s, jax.eval_shape(tx.init, params), shard,
                                      transform_non_params=lambda _: NamedSharding(mesh, P()))

    def step(params, opt_state, batch):
        grads = jax.grad(loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    batch = NamedSharding(mesh, P("data"))
    return (jax.jit(step, in_shardings=(shard, opt_shard, batch), out_shardings=(shard, opt_shard),
                    donate_argnums=(0, 1)), shard, opt_shard, tx)


def _peak(compiled) -> int:
    m = compiled.memory_analysis()
    return int(m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes)


def collectives(hlo: str) -> dict:
    """{kind: {"count", "bytes"}} of the compiled step's all-gathers, reduce-scatters and all-reduces, per step
    (`jdp.inspect.comm.parse_collectives`: each op's full payload; an op in a while loop's body (the
    scanned layers) counted once per trip, XLA's `known_trip_count`)."""
    import re

    from jdp.inspect.comm import parse_collectives

    trips = {body: int(n) for body, n in re.findall(r"while\(.*?body=%?([\w.\-]+).*?known_trip_count\":\{\"n\":\"(\d+)",
                                                     hlo)}
    found = parse_collectives(hlo)
    return {k: {"count": sum(trips.get(c["computation"], 1) for c in found if c["kind"] == k),
                "bytes": sum(c["bytes"] * trips.get(c["computation"], 1) for c in found if c["kind"] == k)}
            for k in COLLECTIVES}


def _jdp_compiled(graphdef, rest, params, layout: str, g: dict):
    """One jdp layout's step compiled on abstract state and batch (nothing allocated)."""
    import jax
    import numpy as np

    step = jdp_step(graphdef, rest, layout)
    step.layout.bind(params)
    init = jax.jit(step._init_state, out_shardings=step.layout.state_shardings)
    state = jax.eval_shape(init, params, (), jax.ShapeDtypeStruct((2,), np.uint32), {})
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.NamedSharding(
        step.mesh, jax.sharding.PartitionSpec(step.mesh.axis_names[0]))), _batch(g, N, True))
    return step._step.lower(state, batch).compile()


def memory(size: str) -> dict:
    """Peak bytes per device of every layout's compiled step for one size (abstract state: nothing allocated),
    and the collectives of the FSDP rows that gather per layer."""
    import jax
    import numpy as np
    from flax import nnx

    model, g = _model(size)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    count = int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))
    out = {"size": size, "model": g, "params": count, "peak": {}, "collectives": {},
           "jit": "available"}
    for layout in jdp_layouts():
        try:
            compiled = _jdp_compiled(graphdef, rest, params, layout, g)
        except Exception as e:  # noqa: BLE001 - a new backend's failure is a row of the table, not the end of it
            if layout != "jit":
                raise
            out["jit"] = f"failed: {type(e).__name__}: {e}"[:300]
            continue
        out["peak"][layout] = _peak(compiled)
        if layout in ("fsdp_layers", "jit"):
            out["collectives"][layout] = collectives(compiled.as_text())
    abstract = lambda tree, sh: jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),  # noqa: E731
                                             tree, sh)
    batch = abstract(_batch(g, N, True), {"x": shard_batch(), "y": shard_batch()})
    for name, pinned in PARTITIONERS.items():
        jitted, shard, opt_shard, tx = partitioner_step(graphdef, rest, params, pinned)
        compiled = jitted.lower(abstract(params, shard), abstract(jax.eval_shape(tx.init, params), opt_shard),
                                batch).compile()
        out["peak"][name], out["collectives"][name] = _peak(compiled), collectives(compiled.as_text())
    return out


def shard_batch():
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    return NamedSharding(Mesh(jax.devices()[:N], ("data",)), P("data"))


def step_times(size: str = "2M", rounds: int = 5, steps: int = 3) -> dict:
    """Interleaved step times on `size` (the smallest): FSDP per layer, the partitioner's FSDP pinned and
    not pinned, replicated, and jdp's jit backend under FSDP where jdp has it."""
    import jax
    from flax import nnx

    model, g = _model(size, abstract=False)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    host = _batch(g, N, False)
    runners = {}
    failed = {}
    for layout in ("replicated", "fsdp_layers", "jit"):
        try:
            step = jdp_step(graphdef, rest, layout)
            box = {"state": step.init(params)}
            placed = step.shard_batch(host)
        except Exception as e:  # noqa: BLE001 - as in memory(): the jit row says why it has no time
            if layout != "jit":
                raise
            failed[layout] = f"failed: {type(e).__name__}: {e}"[:300]
            continue

        def run(k, step=step, box=box, placed=placed):
            t0 = time.perf_counter()
            for _ in range(k):
                box["state"], metrics = step(box["state"], placed)
            jax.block_until_ready(metrics["loss"])
            return (time.perf_counter() - t0) / k
        run(1)
        runners[layout] = run
    pbatch = jax.device_put(host, shard_batch())
    for name, pinned in PARTITIONERS.items():
        jitted, shard, opt_shard, tx = partitioner_step(graphdef, rest, params, pinned)
        pbox = {"p": jax.device_put(params, shard)}
        pbox["o"] = jax.jit(tx.init, out_shardings=opt_shard)(pbox["p"])

        def run_partitioner(k, jitted=jitted, pbox=pbox):
            t0 = time.perf_counter()
            for _ in range(k):
                pbox["p"], pbox["o"] = jitted(pbox["p"], pbox["o"], pbatch)
            jax.block_until_ready(pbox["p"])
            return (time.perf_counter() - t0) / k
        run_partitioner(1)
        runners[name] = run_partitioner
    times = interleave(runners, steps, rounds, log=lambda *_: None)
    out = {"rounds": rounds, "steps": steps, "median_s": {k: sorted(v)[len(v) // 2] for k, v in times.items()},
           "failed": failed}
    for num, den in (("fsdp_layers", "partitioner"), ("fsdp_layers", "partitioner_unpinned"),
                     ("fsdp_layers", "replicated"), ("jit", "fsdp_layers"), ("jit", "partitioner")):
        if num in times and den in times:
            out[f"{num}_over_{den}"] = paired_ratio(times[num], times[den])
    return out


def slopes(rows: list[dict]) -> dict:
    """Least-squares slope (bytes per param) and intercept of each layout's peak over the sizes, and the
    largest model whose peak fits 16 GB and 80 GB per device."""
    import numpy as np

    x = np.array([r["params"] for r in rows], float)
    out = {}
    for layout in rows[0]["peak"]:
        y = np.array([r["peak"][layout] for r in rows], float)
        slope, intercept = np.polyfit(x, y, 1)
        out[layout] = {"slope": slope, "intercept": intercept,
                       "fits_16GB": (16e9 - intercept) / slope, "fits_80GB": (80e9 - intercept) / slope}
    return out


ROW_NAMES = {"partitioner": "partitioner (residual stream pinned)",
             "partitioner_unpinned": "partitioner, residual stream not pinned", "jit": "jdp backend=\"jit\""}


def markdown(rows: list[dict], fit: dict, times: dict | None) -> str:
    names = list(rows[0]["peak"])
    out = [f"GPT, {rows[0]['model']['n_layers']} layers scanned with remat, context {COMMON['context']}, "
           f"{COMMON['per_device']} sequences per device, Adam in float32, N = {N} fake CPU devices. Peak per "
           f"device of the compiled step (argument + output − alias + temp), MB:", "",
           "| layout | " + " | ".join(f"{r['size']} ({r['params']:,} params)" for r in rows)
           + " | slope B/param | largest model in 16 GB | in 80 GB |", "|---|" + "---|" * (len(rows) + 3)]
    for name in names:
        f = fit[name]
        out.append(f"| {ROW_NAMES.get(name, name)} | " + " | ".join(f"{r['peak'][name] / 1e6:.1f}" for r in rows)
                   + f" | {f['slope']:.2f} | {f['fits_16GB'] / 1e9:.2f} B | {f['fits_80GB'] / 1e9:.1f} B |")
    if "jit" not in names:
        out.append(f"| {ROW_NAMES['jit']} | " + " | ".join(str(r.get("jit", "not available")) for r in rows)
                   + " | | | |")
    out += ["", "FSDP per layer / the partitioner's FSDP, slope: "
            + ", ".join(f"{fit['fsdp_layers']['slope'] / fit[p]['slope']:.3f} ({ROW_NAMES[p]})"
                        for p in PARTITIONERS) + "."]
    small = rows[0]
    out += ["", f"Collectives per step of the {small['size']} GPT's compiled step, count and MB (each op's full "
            "payload; those inside the scanned layers' loops once per layer):", "",
            "| layout | " + " | ".join(COLLECTIVES) + " |", "|---|" + "---|" * len(COLLECTIVES)]
    for name, kinds in small["collectives"].items():
        out.append(f"| {ROW_NAMES.get(name, name)} | "
                   + " | ".join(f"{kinds[k]['count']}, {kinds[k]['bytes'] / 1e6:.1f}" for k in COLLECTIVES) + " |")
    if times:
        ratios = [k for k in times if "_over_" in k]
        out += ["", f"Step time, the {small['size']} GPT, {times['rounds']} interleaved rounds of {times['steps']} "
                "steps in one process: " + ", ".join(f"{k.replace('_over_', ' / ')} {times[k]:.3f}" for k in ratios)
                + " (medians " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in times["median_s"].items()) + ")."]
        out += [f"{ROW_NAMES.get(k, k)}: no step time, {why}" for k, why in times.get("failed", {}).items()]
    return "\n".join(out) + "\n"


def bench_fsdp_layers(log=print, quick: bool = False) -> dict:
    """Every size's peaks and the step times, each in a fresh process; the slopes and their ratio
    (`quick`: on QUICK_SIZES, one round of one step for the times)."""
    rows = []
    for size in QUICK_SIZES if quick else SIZES:
        result = fresh_process_result("benchmarks.fsdp_layers", "memory", size, timeout=1200)
        if "error" in result:
            return {"error": f"size {size}: {result['error']}"}
        log(f"    {size}: " + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in result["peak"].items()))
        rows.append(result)
    times = fresh_process_result("benchmarks.fsdp_layers", "time", *(["q1", "1", "1"] if quick else []),
                                 timeout=1200)
    fit = slopes(rows)
    out = {"rows": rows, "fit": fit, "times": None if "error" in times else times,
           "slope_over_partitioner": fit["fsdp_layers"]["slope"] / fit["partitioner"]["slope"],
           "slope_over_partitioner_unpinned": fit["fsdp_layers"]["slope"] / fit["partitioner_unpinned"]["slope"]}
    if out["times"]:
        out["fsdp_layers_over_partitioner"] = times["fsdp_layers_over_partitioner"]
    return out


def table() -> str:
    t0 = time.perf_counter()
    result = bench_fsdp_layers()
    if "error" in result:
        raise SystemExit(result["error"])
    rows, fit, times = result["rows"], result["fit"], result["times"]
    text = (f"# FSDP per layer vs the partitioner, measured\n\n`python -m benchmarks.fsdp_layers table` on "
            f"{os.cpu_count()} CPU cores, {time.strftime('%Y-%m-%d')}, {time.perf_counter() - t0:.0f} s.\n\n"
            + markdown(rows, fit, times))
    with open(RESULTS, "w") as f:
        f.write(text)
    with open(RESULTS.replace(".md", ".json"), "w") as f:
        json.dump({"rows": rows, "fit": fit, "times": times}, f, indent=1)
    return text


if __name__ == "__main__":
    if sys.argv[1:2] in (["memory"], ["time"]):
        import jdp.cpu

        jdp.cpu.use_cpu_devices(N)
        rest = sys.argv[2:]  # memory SIZE | time [SIZE [ROUNDS [STEPS]]]
        print("RESULT " + json.dumps(memory(rest[0]) if sys.argv[1] == "memory" else
                                     step_times(*rest[:1], *(int(r) for r in rest[1:3]))))
    elif sys.argv[1:] == ["table"]:
        print(table())
    else:
        sys.exit("usage: python -m benchmarks.fsdp_layers memory SIZE | time [SIZE [ROUNDS [STEPS]]] | table")
