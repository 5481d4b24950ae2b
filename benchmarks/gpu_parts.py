"""The measuring parts of benchmarks/gpu_check.sh, each run in a process of its own by
`benchmarks.gpu_check` as `python -m benchmarks.gpu_parts PART PLAN RESULT.json`.

A part writes what it has measured to RESULT.json after every measurement (`emit`), so a part
stopped at its time limit, or failing half way, still leaves its first numbers for the report.
`Plan` holds the sizes: FULL for one H200 (GPT-2 small), DRY for a rehearsal on a CPU (tiny GPT).
"""
from __future__ import annotations

import json
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
GPT2_SMALL_CONFIG = os.path.join(ROOT, "configs", "gpt2_small.yaml")
CHAR_VOCAB = 103  # the bundled character corpus's symbols (Python 3.11); the head is d_model x 103


@dataclass(frozen=True)
class Plan:
    """What one run of the check measures, and how long each part may take (seconds)."""

    name: str  # "full": one H200; "dry": this CPU, tiny sizes, same code paths
    gpt: dict  # GPT size: vocab, context, d_model, n_heads, n_layers (attention "fused" always)
    remat: bool  # remat of the fp32-vs-bf16 comparison (the config's)
    throughput_batch: int  # global batch of `context`-token windows for fp32 vs bf16
    flash: bool  # also bf16 with attention="cudnn" (cuDNN flash attention: GPUs only)
    steps: int  # timed steps per repeat
    repeats: int
    explain_ns: tuple  # fake CPU device counts of explain's bf16 section
    fsdp_ns: tuple  # fake CPU device counts the layouts part compiles for (benchmarks.gpu_check_parts)
    optimizers: tuple  # of the exactness part (explain's specs)
    test_platform: str  # JDP_TEST_PLATFORM for the tests part
    budgets: dict  # part -> seconds at most
    deadline_s: int  # the whole check, from its start


def gpt2_small() -> dict:
    """The GPT-2-small config's model and batch (configs/gpt2_small.yaml), as GPT keyword sizes."""
    import yaml

    with open(GPT2_SMALL_CONFIG, encoding="utf-8") as f:
        c = yaml.safe_load(f)
    m = c["model"]
    return {"gpt": {"vocab": CHAR_VOCAB, "context": m["context"], "d_model": m["d_model"], "n_heads": m["n_heads"],
                    "n_layers": m["n_layers"]}, "remat": bool(m.get("remat", True)),
            "batch": c["data"]["batch_size"]}


def full_plan() -> Plan:
    """One H200, ≤ 8 minutes: the parts on the GPU run one after another, each under min(its budget,
    time left); the two CPU parts (fake devices) run beside them from the start. On the H200
    (2026-12-04) env took 3 s, exactness 13 s, throughput 105 s (three compiles of 14-30 s)."""
    cfg = gpt2_small()
    return Plan("full", cfg["gpt"], cfg["remat"], cfg["batch"], flash=True, steps=5, repeats=2,
                explain_ns=(2, 4, 8), fsdp_ns=(8,), optimizers=("sgd", "adam"), test_platform="cuda",
                budgets={"env": 40, "exactness": 40, "tests": 90, "throughput": 110, "fit": 110, "decode": 45,
                         "side_by_side": 150, "cpu_bf16_comm": 240, "layouts": 400}, deadline_s=450)


# A rehearsal checks that every part runs and reports, not how fast: on a loaded CPU the same parts take
# minutes, so its limits only guard against a hang (the GPU plan's budgets are the ones that matter).
DRY = Plan("dry", {"vocab": 32, "context": 16, "d_model": 32, "n_heads": 2, "n_layers": 1}, True, 8, flash=False,
           steps=2, repeats=1, explain_ns=(2,), fsdp_ns=(2,), optimizers=("sgd",), test_platform="cpu",
           budgets=dict.fromkeys(("env", "exactness", "tests", "throughput", "fit", "decode", "side_by_side",
                                  "cpu_bf16_comm", "layouts"), 600), deadline_s=1800)


def plan_named(name: str) -> Plan:
    return DRY if name == "dry" else full_plan()


def part_env(plan: Plan, emit) -> None:
    """Python, the jax/flax/optax versions and packages jdp needs, the devices, their peak FLOP/s."""
    from importlib import metadata

    import jax

    from benchmarks.gpu import peak_flops_for, peak_memory_bytes

    def version(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "missing"

    jax_packages = {name for d in metadata.distributions() if (name := d.metadata["Name"] or "").startswith("jax")}
    names = sorted(jax_packages | {"flax", "optax", "numpy", "orbax-checkpoint", "grain", "rich", "pyyaml",
                                   "scikit-learn"})
    device = jax.devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    emit({"python": sys.version.split()[0], "versions": {n: version(n) for n in names},
          "backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
          "device_kind": device.device_kind, "peak_flops_per_device": peak_flops_for(device.device_kind),
          "memory_limit_bytes": (stats or {}).get("bytes_limit"), "peak_memory_bytes": peak_memory_bytes(device),
          "matmul_precision": str(jax.config.jax_default_matmul_precision),
          "env": {k: os.environ.get(k, "") for k in ("JAX_PLATFORMS", "XLA_FLAGS", "XLA_PYTHON_CLIENT_MEM_FRACTION")}})


def _train_small(devices, optimizer: str, precision="float32", reduce_dtype=None, matmul=None):
    """explain's problem (MLP 8-16-4, K = 3 global batches of 32) trained on `devices`: (the params
    after K steps as host float32 arrays, the step lowered for the first batch)."""
    import jax
    import numpy as np

    from jdp.inspect.explain_common import Problem, matrix_specs, mlp_loss
    from jdp.step import get_params, make_train_step

    problem = Problem.make()
    with jax.default_matmul_precision(matmul) if matmul else nullcontext():
        step = make_train_step(mlp_loss, matrix_specs(1.0)[(optimizer, False)], devices=devices,
                               precision=precision, reduce_dtype=reduce_dtype)
        state = step.init(problem.params)
        scale = np.ones(len(problem.batches[0]["y"]), np.float32)
        lowered = step.lower(state, {**problem.batches[0], "scale": scale})
        for batch in problem.batches:
            state, _ = step(state, {**batch, "scale": scale})
    return get_params(state), lowered


def _hlo_summary(lowered) -> dict:
    """What the program and the compiled step of a reduce_dtype=bf16 step hold: all-reduces, bf16."""
    import re

    from jdp.inspect.comm import parse_collectives

    program, compiled = lowered.as_text(dialect="hlo"), lowered.compile().as_text()
    return {"program_allreduces": len([c for c in parse_collectives(program) if c["kind"] == "all-reduce"]),
            "compiled_allreduces": [{k: c[k] for k in ("bytes", "widened")} for c in parse_collectives(compiled)
                                    if c["kind"] == "all-reduce"],
            "program_bf16_values": len(re.findall(r"= bf16\[", program)),
            "compiled_bf16_values": len(re.findall(r"= bf16\[", compiled))}


def part_exactness(plan: Plan, emit) -> None:
    """(i) bf16 compute and (ii) a bf16 all-reduce on one device of the default backend, against float32
    there (matmuls at "highest") and against float32 on the CPU: max |Δparam| after K steps."""
    import jax

    from jdp.inspect.explain_common import Problem, max_abs_diff

    device = jax.devices()[:1]
    try:
        cpu = jax.devices("cpu")[:1]
    except RuntimeError:  # JAX_PLATFORMS without cpu
        cpu = None
    out = {"device": str(device[0]), "problem": "jdp explain's: MLP 8-16-4, 3 global batches of 32", "runs": {}}
    initial = Problem.make().params
    for optimizer in plan.optimizers:
        ref, _ = _train_small(device, optimizer, matmul="highest")
        cpu_ref = _train_small(cpu, optimizer)[0] if cpu else None
        moved = max_abs_diff(ref, initial)
        runs = {"float32, default matmul precision": {}, "bfloat16 compute": {"precision": "bfloat16"},
                "float32 compute, bf16 reduce_dtype (N=1)": {"reduce_dtype": "bfloat16"}}
        for label, kw in runs.items():
            params, lowered = _train_small(device, optimizer, **kw)
            row = {"vs_float32_here": max_abs_diff(params, ref), "moved": moved,
                   "vs_float32_cpu": max_abs_diff(params, cpu_ref) if cpu else None}
            if "reduce_dtype" in kw:
                row["hlo"] = _hlo_summary(lowered)
            out["runs"][f"{optimizer}: {label}"] = row
        out["runs"][f"{optimizer}: float32 (highest) here vs CPU"] = {
            "vs_float32_cpu": max_abs_diff(ref, cpu_ref) if cpu else None, "moved": moved}
        emit(out)


def part_throughput(plan: Plan, emit) -> None:
    """(b) float32 vs bfloat16: step time, tokens/s, MFU of the GPT at the plan's global batch, with
    "fused" attention (XLA's, as the config) and, on a GPU, bf16 with cuDNN flash attention too."""
    from benchmarks.gpu import gpt_benchmark

    runs = {"float32": ("float32", "fused"), "bfloat16": ("bfloat16", "fused")}
    if plan.flash:
        runs["bfloat16, cudnn attention"] = ("bfloat16", "cudnn")
    out = {}
    for label, (precision, attention) in runs.items():
        out[label] = gpt_benchmark(**plan.gpt, batch_candidates=(plan.throughput_batch,), steps=plan.steps,
                                   repeats=plan.repeats, precision=precision, attention=attention,
                                   remat=plan.remat, log=lambda *a: None)
        emit(out)


def part_cpu_bf16_comm(plan: Plan, emit) -> None:
    """(d iii) `jdp explain`'s bf16 gradient communication on fake CPU devices (JAX_PLATFORMS=cpu)."""
    import jdp.cpu

    jdp.cpu.use_cpu_devices(max(8, *plan.explain_ns))
    from jdp.inspect.explain_common import cached_step
    from jdp.inspect.explain_precision import bf16_communication

    t0 = time.perf_counter()
    section = bf16_communication(plan.explain_ns)
    cached_step.cache_clear()
    emit({"platform": "CPU, fake devices", **section, "seconds": round(time.perf_counter() - t0, 1)})


def compiled_layouts(plan: Plan, n: int, devices, layouts: dict) -> dict:
    """The GPT's bf16 AdamW step for `n` of `devices` in each of `layouts` (name -> make_train_step
    options), lowered from abstract values
    (shapes and shardings only: nothing is placed or run) and compiled: XLA's memory analysis and
    the compiled program's collectives."""
    import re

    import jax
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jdp
    from jdp.inspect.comm import parse_collectives
    from jdp.models import GPT

    g = plan.gpt
    per_device = max(1, plan.throughput_batch // max(plan.fsdp_ns))

    def loss_fn(model, batch):
        return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"], train=False), batch["y"]).mean()

    out = {}
    for layout, options in layouts.items():
        t0 = time.perf_counter()
        model = GPT(g["vocab"], g["context"], d_model=g["d_model"], n_heads=g["n_heads"], n_layers=g["n_layers"],
                    dropout=0.0, dtype="bfloat16", attention="fused", remat=plan.remat, rngs=nnx.Rngs(0))
        step = jdp.nnx.make_train_step(model, loss_fn, optax.adamw(1e-4), devices=devices[:n], precision="bfloat16",
                                       grad_norm=False, **options)
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype),
                              (step.model.params, step.model.rest))
        state = jax.eval_shape(lambda p, r: step.step.init(p, r), *shapes)
        tokens = jax.ShapeDtypeStruct((per_device * n, g["context"]), np.int32,
                                      sharding=NamedSharding(step.mesh, P(step.mesh.axis_names[0])))
        compiled = step.step._step.lower(state, {"x": tokens, "y": tokens}).compile()
        stats, hlo = compiled.memory_analysis(), compiled.as_text()
        found = parse_collectives(hlo)
        out[layout] = {"compile_s": round(time.perf_counter() - t0, 1),
                       **{k: int(getattr(stats, f"{k}_size_in_bytes"))
                          for k in ("argument", "output", "alias", "temp")},
                       "peak": int(getattr(stats, "peak_memory_in_bytes", 0) or 0),
                       "collectives": {kind: {"count": sum(c["kind"] == kind for c in found),
                                              "bytes": sum(c["bytes"] for c in found if c["kind"] == kind)}
                                       for kind in ("all-reduce", "reduce-scatter", "all-gather")},
                       "async_starts": len(re.findall(r"(?:all-gather|all-reduce|reduce-scatter|async)-start\(", hlo))}
        out["model"] = {"params": int(sum(np.size(x) for x in jax.tree.leaves(shapes[0]))), "per_device": per_device,
                        "context": g["context"], "n_layers": g["n_layers"], "d_model": g["d_model"],
                        "remat": plan.remat}
    return out


PARTS = {"env": part_env, "exactness": part_exactness, "throughput": part_throughput,
         "cpu_bf16_comm": part_cpu_bf16_comm}


def main(argv) -> int:
    part, plan_name, result_path = argv

    def emit(result: dict) -> None:
        tmp = result_path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1, default=str)
        os.replace(tmp, result_path)  # the reader never sees half a file

    PARTS[part](plan_named(plan_name), emit)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
