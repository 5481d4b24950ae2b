"""jdp's performance against plain JAX, PyTorch DDP and its own host loop, in one run.

  python -m benchmarks.run                 # full run (~5-8 min on a 2-core CPU)
  python -m benchmarks.run --quick         # small sizes, few steps (a few minutes), for tests
  python -m benchmarks.run --skip-ddp --out /tmp/bench
  python -m benchmarks.run --parts handwritten,train_loop   # some parts only

On CPU (2 fake CPU devices, fp32, Adam, global batch 256, MLP 784-1024-1024-10 unless noted):

1. jdp's step (shard_map, pmap) vs a minimal hand-written `jit(shard_map)` step with `lax.pmean`,
   and vs a minimal hand-written `jax.pmap` step (state stacked per device, donated: the classic
   loop); every contender gets the same batches, already placed on the devices, and returns the
   loss only (jdp with grad_norm=False); jdp with its default grad_norm metric shows its cost.
2. jdp's step and the hand-written one vs PyTorch DistributedDataParallel (gloo, 2 processes ×
   1 thread); skipped if
   torch is not installed (`pip install -e '.[bench]'`).
3. `jdp.train.train` (the host loop: data pipeline, transfers, logging) vs the compiled step alone
   on pre-staged batches, same task (MLP 64-1024-1024-10 on digits).
4. Gradient accumulation, M = 4: accum_sync="every" vs "last", time per optimizer step and
   `jdp.comm_report`.
5. Scaling over 1, 2, 4, 8 fake devices (a fresh process each) and three model sizes: step
   time, first-call (compile) time, bytes per device of params + grads + Adam state.
6. The optimizer state sharded (ZeRO-1) vs replicated: step time (ratio), and bytes per device of
   params, gradient and optimizer state for N = 1, 2, 4, 8 (`benchmarks/zero.py`).
7. Params, gradient and optimizer state sharded (FSDP) vs ZeRO-1 vs replicated: step time
   (target: FSDP ≤ 1.3× replicated), and an 8-layer GPT's bytes per device, between steps and in
   the compiled step, for N = 1, 2, 4, 8, remat off and on (`benchmarks/fsdp.py`).
7b. `fsdp_layers`: a scanned GPT at three sizes on 8 devices, the compiled step's peak per layout
   (FSDP gathering per layer vs the partitioner's FSDP, its residual stream pinned batch-sharded as
   MaxText does, and not pinned: slope in bytes per param, collectives) and step-time ratios (`benchmarks/fsdp_layers.py`; about 12 minutes on 2 CPU cores).
8. The input pipeline (`benchmarks/data.py`): loader batches/s for a token file and for a
   transform-heavy grain source (inline, 2 threads, 2 worker processes) against the char GPT's
   step rate on 2 devices (target: loader ≥ 5× the step), and RssAnon for a 10 MB and a 1 GB
   token file.

Contenders are timed in alternating windows (A, B, A, B, ...) with block_until_ready at the end
of each window; the report gives medians and ratios, never absolute targets: this machine is
noisy. On a GPU (jax.default_backend() == "gpu") the run measures a bf16 GPT and its MFU
instead (`benchmarks/gpu.py`, untested on a GPU).

Writes OUT/report.json, OUT/report.md and OUT/throughput.png (OUT: benchmarks/results).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from benchmarks.common import (BIG_MLP, GLOBAL_BATCH, Timer, child_env, interleave, mlp_batches, mlp_loss, mlp_params,
                               paired_ratio, param_count, ratio_spread, summary)
from benchmarks.fsdp import bench_fsdp
from benchmarks.fsdp_layers import bench_fsdp_layers
from benchmarks.data import bench_data
from benchmarks.zero import bench_zero

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TARGETS = {"handwritten_over_jdp_shard_map": 0.97, "handwritten_over_jdp_pmap": 0.97,
           "handwritten_pmap_over_jdp_pmap": 0.97, "ddp_over_jdp": 2.5, "train_loop_over_step": 0.95,
           "replicated_over_fsdp": 0.77,  # FSDP at most ~1.3x the replicated step
           "loader_tokens_over_step": 5.0, "loader_transform_over_step": 5.0}
PARTS = ("handwritten", "ddp", "train_loop", "accum", "scaling", "zero", "fsdp", "fsdp_layers", "data")
ADAM_FP32_BYTES_PER_PARAM = 16  # params 4 + grads 4 + Adam m 4 + v 4 (fp32 on CPU)
ADAMW_MIXED_BYTES_PER_PARAM = 16  # AdamW in mixed precision: fp32 master 4 + m 4 + v 4 + bf16 weights 2 + bf16 grads 2


@dataclass(frozen=True)
class Plan:
    """How much to measure."""

    sizes: tuple  # MLP of parts 1, 2 and 4
    steps: int  # steps per timed window
    repeats: int  # windows per contender
    train_hidden: tuple  # part 3's MLP hidden widths (input 64: digits)
    train_steps: int
    train_log_every: int
    train_repeats: int
    accum_steps_timed: int  # optimizer steps per window in part 4
    scaling_devices: tuple
    scaling_sizes: tuple
    scaling_steps: int
    scaling_repeats: int


FULL = Plan(sizes=BIG_MLP, steps=10, repeats=30, train_hidden=(1024, 1024), train_steps=150, train_log_every=25,
            train_repeats=5, accum_steps_timed=5, scaling_devices=(1, 2, 4, 8),
            scaling_sizes=((784, 256, 256, 10), BIG_MLP, (784, 2048, 2048, 10)), scaling_steps=5,
            scaling_repeats=3)
QUICK = Plan(sizes=(784, 256, 256, 10), steps=5, repeats=3, train_hidden=(256, 256), train_steps=30,
             train_log_every=5, train_repeats=2, accum_steps_timed=2, scaling_devices=(1, 2),
             scaling_sizes=((784, 256, 256, 10),), scaling_steps=3, scaling_repeats=2)


def log(msg: str) -> None:
    print(msg, flush=True)


def machine_info() -> dict:
    import jax
    import jaxlib

    try:
        import torch
        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    d = jax.devices()[0]
    cpu_model = ""
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpu_model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    return {"cpu_count": os.cpu_count(), "cpu_model": cpu_model, "python": platform.python_version(),
            "jax": jax.__version__, "jaxlib": jaxlib.__version__, "backend": jax.default_backend(),
            "device_kind": d.device_kind, "devices": jax.device_count(), "torch": torch_version,
            "pjrt_nproc": os.environ.get("PJRT_NPROC"),
            # compiler flags change the times (the tests run this with LLVM at -O0): a report says which
            "xla_flags": os.environ.get("XLA_FLAGS", "")}


def _window(step_once, state_box, placed, sync):
    """run(n): n calls of step_once on the placed batches, then block on the state."""
    def run(n):
        with Timer() as t:
            for i in range(n):
                state_box[0] = step_once(state_box[0], placed[i % len(placed)])
            sync(state_box[0])
        return t.seconds
    return run


def _handwritten(params, mesh, placed):
    """The minimal hand-written `jit(shard_map)` + `pmean` Adam step on `mesh`, returning the loss.

    Returns `(run, box, hand_step)`: its timing window over the `placed` batches, the box holding
    its (params, Adam state), and the per-device step function (for a `jax.pmap` of it).
    """
    import jax
    import numpy as np
    import optax
    from jax import lax
    from jax.sharding import PartitionSpec as P

    import jdp

    tx = optax.adam(1e-3)

    def hand_step(ps, opt, batch):
        loss, g = jax.value_and_grad(mlp_loss)(ps, batch)
        g = lax.pmean(g, "data")
        updates, opt = tx.update(g, opt, ps)
        return optax.apply_updates(ps, updates), opt, lax.pmean(loss, "data")

    hand = jax.jit(jax.shard_map(hand_step, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P(), P()),
                                 check_vma=False), donate_argnums=(0, 1))
    rep = jdp.core.mesh.replicated(mesh)
    hp = jax.device_put(jax.tree.map(np.asarray, params), rep)
    box = [(hp, jax.jit(tx.init, out_shardings=rep)(hp))]

    def once(s, batch):
        ps, opt, _ = hand(s[0], s[1], batch)
        return ps, opt

    return _window(once, box, placed, jax.block_until_ready), box, hand_step


def bench_handwritten(plan: Plan) -> dict:
    """Part 1: jdp (shard_map, pmap) vs a minimal hand-written jit(shard_map) + pmean step."""
    import jax
    import numpy as np
    import optax

    import jdp

    sizes = plan.sizes
    params, batches = mlp_params(sizes), mlp_batches(sizes, 8)
    # The hand-written steps return the loss only; jdp does the same work with grad_norm=False.
    # jdp_shard_map_grad_norm (the default) shows what the extra metric costs.
    sm = jdp.make_train_step(mlp_loss, optax.adam(1e-3), backend="shard_map", grad_norm=False)
    pm = jdp.make_train_step(mlp_loss, optax.adam(1e-3), backend="pmap", grad_norm=False)
    sm_norm = jdp.make_train_step(mlp_loss, optax.adam(1e-3), backend="shard_map")
    placed = [sm.shard_batch(b) for b in batches]  # global arrays, split over the "data" axis
    pm_placed = [pm.shard_batch(b) for b in batches]  # pmap's layout: (devices, b, ...)

    # Does each step take its own placed batches as they are? shard_batch is what __call__ applies.
    def passes_through(step, tree):
        return all(a is b for a, b in zip(jax.tree.leaves(step.shard_batch(tree)), jax.tree.leaves(tree)))

    sm_no_copy, pm_no_copy = passes_through(sm, placed[0]), passes_through(pm, pm_placed[0])

    pm_init = pm.init(params)  # the stacked (N, ...) params and Adam state the classic pmap loop keeps
    hand_run, hand_box, hand_step = _handwritten(params, sm.mesh, placed)
    hand_pmap = jax.pmap(hand_step, axis_name="data", devices=pm.devices, donate_argnums=(0, 1))
    hand_pmap_box = [(pm_init.params, pm_init.opt_state)]

    def hand_pmap_once(s, batch):
        ps, opt, _ = hand_pmap(s[0], s[1], batch)
        return ps, opt

    sm_box, pm_box = [sm.init(params)], [pm.init(params)]
    runners = {"handwritten": hand_run,
               "jdp_shard_map": _window(lambda s, b: sm(s, b)[0], sm_box, placed, jax.block_until_ready),
               "jdp_pmap": _window(lambda s, b: pm(s, b)[0], pm_box, pm_placed, jax.block_until_ready),
               "handwritten_pmap": _window(hand_pmap_once, hand_pmap_box, pm_placed, jax.block_until_ready),
               "jdp_shard_map_grad_norm": _window(lambda s, b: sm_norm(s, b)[0], [sm_norm.init(params)], placed,
                                                  jax.block_until_ready)}
    first = {}
    for name, run in runners.items():
        first[name] = run(1)
        run(3)
    # Same data, same init: after the same steps the three should agree (a sanity check).
    diffs = {name: float(max(np.max(np.abs(np.asarray(a) - np.asarray(b)))
                         for a, b in zip(jax.tree.leaves(jdp.get_params(box[0])), jax.tree.leaves(
                             jax.device_get(hand_box[0][0])))))
             for name, box in (("jdp_shard_map", sm_box), ("jdp_pmap", pm_box))}
    diffs["handwritten_pmap"] = float(max(np.max(np.abs(np.asarray(a)[0] - np.asarray(b))) for a, b in zip(
        jax.tree.leaves(hand_pmap_box[0][0]), jax.tree.leaves(jax.device_get(hand_box[0][0])))))
    log(f"  part 1: MLP {'-'.join(map(str, sizes))}, {plan.repeats} rounds of {plan.steps} steps")
    times = interleave(runners, plan.steps, plan.repeats, log=log)
    return {"mlp": list(sizes), "params": param_count(sizes), "global_batch": GLOBAL_BATCH, "devices": sm.num_devices,
            "first_call_s": first, "contenders": {n: summary(t, GLOBAL_BATCH) for n, t in times.items()},
            "ratio_handwritten_over_jdp_shard_map": paired_ratio(times["handwritten"], times["jdp_shard_map"]),
            "ratio_handwritten_over_jdp_pmap": paired_ratio(times["handwritten"], times["jdp_pmap"]),
            "ratio_handwritten_pmap_over_jdp_pmap": paired_ratio(times["handwritten_pmap"], times["jdp_pmap"]),
            "ratio_handwritten_over_handwritten_pmap": paired_ratio(times["handwritten"], times["handwritten_pmap"]),
            "ratio_handwritten_over_jdp_shard_map_grad_norm": paired_ratio(times["handwritten"],
                                                                          times["jdp_shard_map_grad_norm"]),
            "spread": {"handwritten_over_jdp_shard_map": ratio_spread(times["handwritten"], times["jdp_shard_map"]),
                       "handwritten_over_jdp_pmap": ratio_spread(times["handwritten"], times["jdp_pmap"]),
                       "handwritten_pmap_over_jdp_pmap": ratio_spread(times["handwritten_pmap"], times["jdp_pmap"])},
            "max_param_diff_vs_handwritten_after_4_steps": diffs,
            "placed_batch": {"shard_map_takes_placed_arrays_without_copy": sm_no_copy,
                             "pmap_takes_placed_arrays_without_copy": pm_no_copy}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DDP:
    """Two PyTorch DDP ranks (benchmarks/ddp_worker.py), driven over stdin/stdout."""

    def __init__(self, sizes, world: int = 2):
        port = _free_port()
        env = child_env(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
                        PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.ddp_worker", str(r), str(world), str(port),
                                        ",".join(map(str, sizes)), str(GLOBAL_BATCH)], cwd=ROOT, env=env,
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                      for r in range(world)]
        for p in self.procs:
            line = p.stdout.readline()
            if line.strip() != "ready":
                self.close()
                raise RuntimeError(f"a DDP worker did not start (said {line!r}, exit code {p.poll()})")

    def run(self, n: int) -> float:
        for p in self.procs:
            p.stdin.write(f"run {n}\n")
            p.stdin.flush()
        return max(float(p.stdout.readline().split()[1]) for p in self.procs)

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.stdin.write("stop\n")
                    p.stdin.flush()
                    p.wait(timeout=20)
                except Exception:  # noqa: BLE001
                    p.kill()


def bench_ddp(plan: Plan) -> dict:
    """Part 2: jdp's shard_map step vs PyTorch DDP (gloo, 2 processes, 1 thread each)."""
    try:
        import torch
    except ImportError:
        return {"skipped": "torch is not installed (pip install -e '.[bench]')"}
    import jax
    import optax

    import jdp

    sizes = plan.sizes
    step = jdp.make_train_step(mlp_loss, optax.adam(1e-3), grad_norm=False)  # DDP's step returns the loss only
    placed = [step.shard_batch(b) for b in mlp_batches(sizes, 8)]
    box = [step.init(mlp_params(sizes))]
    jdp_run = _window(lambda s, b: step(s, b)[0], box, placed, jax.block_until_ready)
    jdp_run(4)
    hand_run = _handwritten(mlp_params(sizes), step.mesh, placed)[0]  # DDP against plain JAX, same run
    hand_run(4)
    try:
        ddp = DDP(sizes)
    except Exception as e:  # noqa: BLE001
        return {"skipped": f"DDP workers failed: {e}"}
    try:
        ddp.run(2)
        log(f"  part 2: jdp vs PyTorch {torch.__version__} DDP (gloo, 2 processes × 1 thread)")
        times = interleave({"jdp_shard_map": jdp_run, "torch_ddp": ddp.run, "handwritten": hand_run}, plan.steps,
                           plan.repeats, log=log)
    finally:
        ddp.close()
    return {"mlp": list(sizes), "global_batch": GLOBAL_BATCH, "torch": torch.__version__,
            "ddp": "gloo, 2 processes, torch.set_num_threads(1), 128 examples each",
            "contenders": {n: summary(t, GLOBAL_BATCH) for n, t in times.items()},
            "ratio_ddp_over_jdp": paired_ratio(times["torch_ddp"], times["jdp_shard_map"]),
            "ratio_ddp_over_handwritten": paired_ratio(times["torch_ddp"], times["handwritten"]),
            "spread": {"ddp_over_jdp": ratio_spread(times["torch_ddp"], times["jdp_shard_map"])}}


def bench_train_loop(plan: Plan) -> dict:
    """Part 3: `jdp.train.train` (host loop) vs the compiled step alone on pre-staged batches."""
    import jax
    import numpy as np

    from jdp.config import load_config
    from jdp.step import make_train_step
    from jdp.run.tasks import build_task
    from jdp.train import load_metrics, train

    overrides = [f"model.hidden={list(plan.train_hidden)}", f"data.batch_size={GLOBAL_BATCH}",
                 f"train.steps={plan.train_steps}", f"train.log_every={plan.train_log_every}", "parallel.devices=2"]
    config = load_config(None, overrides)
    task = build_task(config)
    devices = jax.devices()[:2]
    p = config.parallel
    step = make_train_step(task.loss_fn, config.optimizer_spec(), backend=p.backend, reduction=p.reduction,
                           lr_correction=p.lr_correction, devices=devices, has_aux=True, needs_rng=True, has_state=True,
                           accum_steps=p.accum_steps, accum_sync=p.accum_sync,
                           skip_nonfinite=config.train.max_nonfinite > 0)
    arrays = task.train.arrays
    rng = np.random.default_rng(0)
    placed = []
    for _ in range(4):
        idx = rng.choice(len(arrays["y"]), GLOBAL_BATCH, replace=False)
        placed.append(step.shard_batch({k: v[idx] for k, v in arrays.items()}))
    box = [step.init(task.params, task.model_state, seed=config.train.seed)]
    step_run = _window(lambda s, b: step(s, b)[0], box, placed, jax.block_until_ready)
    step_run(4)
    window = plan.train_steps - plan.train_log_every  # the steps train() is measured over
    train_rates, step_rates, train_seconds = [], [], []
    log(f"  part 3: jdp.train.train ({plan.train_steps} steps, log every {plan.train_log_every}) vs the step alone "
        f"({window} steps), {plan.train_repeats} rounds")
    for r in range(plan.train_repeats):
        with tempfile.TemporaryDirectory() as workdir:
            res = train(config, workdir, devices=devices, log=lambda *a: None, progress=False)
            records = [rec for rec in load_metrics(workdir) if "samples_per_s" in rec]
        # The first interval holds compilation and the cost analysis; the rest is the steady loop.
        steady = [rec["samples_per_s"] for rec in records if rec["step"] > plan.train_log_every]
        train_rates.append(len(steady) / sum(1 / x for x in steady))  # harmonic mean = total samples / total time
        train_seconds.append(res.seconds)
        step_rates.append(GLOBAL_BATCH * window / step_run(window))
        log(f"    round {r + 1}/{plan.train_repeats}: train loop {train_rates[-1]:,.0f} samples/s, "
            f"step alone {step_rates[-1]:,.0f} samples/s")
    from benchmarks.common import median
    return {"task": task.description, "mlp_hidden": list(plan.train_hidden), "global_batch": GLOBAL_BATCH,
            "devices": 2, "overrides": overrides,
            "train_loop_samples_per_s": median(train_rates), "step_alone_samples_per_s": median(step_rates),
            "train_loop_rounds": train_rates, "step_alone_rounds": step_rates,
            "train_wall_s_incl_compile_eval_checkpoint": train_seconds,
            "ratio_train_loop_over_step": paired_ratio(train_rates, step_rates),
            "spread": {"train_loop_over_step": ratio_spread(train_rates, step_rates)}}


def bench_accum(plan: Plan) -> dict:
    """Part 4: accum_steps=4, accum_sync "every" vs "last": time per optimizer step and comm_report."""
    import jax
    import optax

    import jdp

    sizes, m = plan.sizes, 4
    out, runners = {"mlp": list(sizes), "accum_steps": m, "global_batch": GLOBAL_BATCH, "modes": {}}, {}
    for sync in ("every", "last"):
        step = jdp.make_train_step(mlp_loss, optax.adam(1e-3), accum_steps=m, accum_sync=sync)
        micro = [step.shard_batch(mb) for b in mlp_batches(sizes, 2) for mb in step.micro_batches(b)]
        box = [step.init(mlp_params(sizes))]
        report = jdp.comm_report(step, box[0], micro[0])
        out["modes"][sync] = {"gradient_allreduces_per_update": report.gradient_allreduces_per_update,
                              "allreduce_bytes_per_update": report.bytes_per_update,
                              "ring_bytes_per_device": report.ring_bytes_per_device,
                              "gradient_bytes": report.gradient_bytes, "comm_report": str(report)}
        calls = _window(lambda s, b, step=step: step(s, b)[0], box, micro, jax.block_until_ready)
        calls(2 * m)
        runners[sync] = lambda n, calls=calls: calls(n * m)  # n optimizer steps = n·M calls
    log(f"  part 4: accumulation M={m}, every vs last, {plan.repeats} rounds of {plan.accum_steps_timed} optimizer steps")
    times = interleave(runners, plan.accum_steps_timed, plan.repeats, log=log)
    for sync, t in times.items():
        out["modes"][sync].update(summary(t, GLOBAL_BATCH))
    out["ratio_every_over_last"] = paired_ratio(times["every"], times["last"])
    return out


def bench_scaling(plan: Plan) -> dict:
    """Part 5: one fresh process per device count (benchmarks/scaling_worker.py)."""
    env = child_env(PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    rows, errors = [], {}
    for n in plan.scaling_devices:
        log(f"  part 5: {n} device(s), sizes {[s[1] for s in plan.scaling_sizes]}")
        r = subprocess.run([sys.executable, "-m", "benchmarks.scaling_worker", str(n), str(plan.scaling_steps),
                            str(plan.scaling_repeats), *[",".join(map(str, s)) for s in plan.scaling_sizes]],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        lines = [line for line in r.stdout.splitlines() if line.startswith("RESULT ")]
        if r.returncode != 0 or not lines:
            errors[str(n)] = (r.stderr.strip().splitlines() or ["no output"])[-1]
            log(f"    {n} devices FAILED: {errors[str(n)]}")
            continue
        for row in json.loads(lines[-1][len("RESULT "):])["rows"]:
            rows.append(row)
            log(f"    {row['params']:,} params: {row['median_step_s'] * 1e3:.1f} ms/step, first call "
                f"{row['first_call_s']:.2f} s, {row['bytes_per_param']:.1f} bytes/param per device")
    return {"global_batch": GLOBAL_BATCH, "note": "strong scaling: the global batch stays 256; the fake devices "
            "share the same CPU cores, so more devices cannot be faster here", "rows": rows, "errors": errors,
            "bytes_per_param_fp32_adam": ADAM_FP32_BYTES_PER_PARAM,
            "bytes_per_param_adamw_mixed_precision": ADAMW_MIXED_BYTES_PER_PARAM}


def ratios_table(report: dict) -> list[dict]:
    rows = []

    spreads = {k: v for part in ("handwritten", "ddp", "train_loop") for k, v in
               report.get(part, {}).get("spread", {}).items()}

    def add(key, value, what):
        if value is not None:
            target = TARGETS.get(key)
            spread = spreads.get(key, {})
            rows.append({"ratio": key, "value": value, "target": target, "q1": spread.get("q1"), "q3": spread.get("q3"),
                         "met": None if target is None else bool(value >= target), "what": what})

    h = report.get("handwritten", {})
    add("handwritten_over_jdp_shard_map", h.get("ratio_handwritten_over_jdp_shard_map"),
        "hand-written jit(shard_map) step time / jdp shard_map step time, both returning the loss only (≥ 1: jdp is as fast)")
    add("handwritten_over_jdp_pmap", h.get("ratio_handwritten_over_jdp_pmap"),
        "hand-written jit(shard_map) step time / jdp pmap step time")
    add("handwritten_pmap_over_jdp_pmap", h.get("ratio_handwritten_pmap_over_jdp_pmap"),
        "hand-written jax.pmap step time / jdp pmap step time (the same backend by hand)")
    add("handwritten_over_jdp_shard_map_grad_norm", h.get("ratio_handwritten_over_jdp_shard_map_grad_norm"),
        "hand-written / jdp shard_map with its default grad_norm metric: what that metric costs")
    add("handwritten_over_handwritten_pmap", h.get("ratio_handwritten_over_handwritten_pmap"),
        "hand-written jit(shard_map) / hand-written jax.pmap step time: what jax.pmap itself costs")
    add("ddp_over_jdp", report.get("ddp", {}).get("ratio_ddp_over_jdp"),
        "PyTorch DDP step time / jdp step time (> 1: jdp is faster)")
    add("ddp_over_handwritten", report.get("ddp", {}).get("ratio_ddp_over_handwritten"),
        "PyTorch DDP step time / hand-written jit(shard_map) step time: plain JAX's lead, same run")
    add("train_loop_over_step", report.get("train_loop", {}).get("ratio_train_loop_over_step"),
        "jdp train samples/s / compiled step alone samples/s")
    add("accum_every_over_last", report.get("accum", {}).get("ratio_every_over_last"),
        "time per optimizer step, accum_sync every / last (M=4)")
    add("zero_sharded_over_replicated", report.get("zero", {}).get("ratio_sharded_over_replicated"),
        "step time with the optimizer state sharded (ZeRO-1) / replicated, Adam")
    add("replicated_over_fsdp", report.get("fsdp", {}).get("ratio_replicated_over_fsdp"),
        "replicated step time / FSDP (shard_params) step time, Adam (≥ 0.77: FSDP ≤ 1.3× replicated)")
    add("fsdp_layers_slope_over_partitioner", report.get("fsdp_layers", {}).get("slope_over_partitioner"),
        "compiled peak per param, FSDP gathering per layer / jax.jit+NamedSharding FSDP (residual stream pinned), "
        "scanned GPT (≤ 1.15)")
    add("fsdp_layers_over_partitioner", report.get("fsdp_layers", {}).get("fsdp_layers_over_partitioner"),
        "step time, FSDP gathering per layer / the partitioner's FSDP, residual stream pinned (≤ 1.15)")
    add("loader_tokens_over_step", report.get("data", {}).get("ratio_loader_tokens_over_step"),
        "token-file loader batches/s / char GPT steps/s on 2 devices (batch 64 × 64 tokens)")
    add("loader_transform_over_step", report.get("data", {}).get("ratio_loader_transform_over_step"),
        "transform-heavy grain source, loader batches/s (best of inline, 2 threads, 2 workers) / char GPT steps/s")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes and few steps (a few minutes)")
    ap.add_argument("--skip-ddp", action="store_true", help="leave out the PyTorch DDP comparison")
    ap.add_argument("--out", default=os.path.join(HERE, "results"), help="output folder (default benchmarks/results)")
    ap.add_argument("--parts", default=",".join(PARTS),
                    help=f"comma-separated CPU parts to run (default all: {','.join(PARTS)})")
    args = ap.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not parts:
        ap.error(f"--parts={args.parts!r} names no known part {unknown}; use a comma-separated subset of "
                 f"{','.join(PARTS)}.")

    import jdp.cpu
    jdp.cpu.use_cpu_devices(2)  # affects the CPU backend only; on a GPU host jax still picks the GPUs
    import jax

    from benchmarks.report import write_report

    plan = QUICK if args.quick else FULL
    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    report = {"mode": "quick" if args.quick else "full", "machine": machine_info(),
              "created": time.strftime("%Y-%m-%d %H:%M:%S %z")}
    log(f"benchmarks.run ({report['mode']}): {report['machine']}")
    if jax.default_backend() == "gpu":
        from benchmarks.gpu import gpt_benchmark
        # precision="bfloat16" (jdp's step and GPT(dtype=bf16)), fused attention; benchmarks/gpu_check.sh
        # adds the float32 comparison, remat and the largest batch for the GPT-2-small config.
        report["gpu"] = (gpt_benchmark(d_model=512, n_layers=8, n_heads=8, context=256, steps=5, repeats=2,
                                       precision="bfloat16") if args.quick else gpt_benchmark(precision="bfloat16"))
        report["gpu"]["untested_note"] = "this GPU path was written without a GPU and never run on one before"
    else:
        benches = {"handwritten": bench_handwritten, "ddp": bench_ddp, "train_loop": bench_train_loop,
                   "accum": bench_accum, "scaling": bench_scaling,
                   "zero": lambda plan: bench_zero(plan.sizes, plan.steps, plan.repeats, log=log),
                   "fsdp": lambda plan: bench_fsdp(plan.sizes, plan.steps, plan.repeats, log=log, quick=args.quick),
                   "fsdp_layers": lambda plan: bench_fsdp_layers(log=log, quick=plan is QUICK),
                   "data": lambda plan: bench_data(plan is QUICK, log=log)}
        for part in PARTS:
            if part in parts:
                skip = part == "ddp" and args.skip_ddp
                report[part] = {"skipped": "--skip-ddp"} if skip else benches[part](plan)
        report["parts"] = parts
    report["ratios"] = ratios_table(report)
    report["seconds"] = time.perf_counter() - t0
    paths = write_report(report, args.out)
    for r in report["ratios"]:
        met = "" if r["met"] is None else (" (target ≥ %g: %s)" % (r["target"], "met" if r["met"] else "NOT met"))
        log(f"{r['ratio']}: {r['value']:.3f}{met}")
    log("wrote " + ", ".join(paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
