"""Shared pieces of `python -m benchmarks.run`: the MLP problem (numpy only, so the PyTorch
workers can import it without jax), the interleaved timer, and the environment of a child process."""
from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GLOBAL_BATCH = 256
_DEVICE_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S*")
# A parent's CPU device count and the XLA thread-pool size chosen for it (jdp/cpu.py).
DEVICE_COUNT_VARS = ("JAX_NUM_CPU_DEVICES", "PJRT_NPROC", "NPROC")


def child_env(*drop: str, **extra: str) -> dict:
    """This process's environment for a fresh jax process that chooses its own CPU device count:
    without the fake device count in XLA_FLAGS (every other XLA flag kept), without
    DEVICE_COUNT_VARS and the variables named in `drop`, with `extra` set."""
    env = {k: v for k, v in os.environ.items() if k not in (*DEVICE_COUNT_VARS, *drop)}
    flags = " ".join(_DEVICE_COUNT_FLAG.sub("", env.pop("XLA_FLAGS", "")).split())
    return {**env, **({"XLA_FLAGS": flags} if flags else {}), **extra}
BIG_MLP = (784, 1024, 1024, 10)


def mlp_params(sizes, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """[(w, b), ...] float32, w ~ N(0, 1/fan_in): the same numbers for jdp, plain JAX and PyTorch."""
    rng = np.random.default_rng(seed)
    return [(rng.normal(0, 1 / np.sqrt(i), (i, o)).astype(np.float32), np.zeros(o, np.float32))
            for i, o in zip(sizes[:-1], sizes[1:])]


def mlp_batches(sizes, count: int, global_batch: int = GLOBAL_BATCH, seed: int = 1) -> list[dict]:
    """`count` global batches {"x": (B, in) float32, "y": (B,) int32}."""
    rng = np.random.default_rng(seed)
    return [{"x": rng.normal(size=(global_batch, sizes[0])).astype(np.float32),
             "y": rng.integers(0, sizes[-1], global_batch).astype(np.int32)} for _ in range(count)]


def param_count(sizes) -> int:
    return int(sum(i * o + o for i, o in zip(sizes[:-1], sizes[1:])))


def interleave(contenders: dict[str, Callable[[int], float]], steps: int, repeats: int,
               log=print, seed: int = 0) -> dict[str, list[float]]:
    """Time `steps` steps of each contender in turn, `repeats` rounds, in a new order each round.

    Each contender is `run(n) -> seconds` for n steps, including a block_until_ready at the end
    of its window. The order is shuffled per round (seeded) so that no contender always runs
    right after the same other one. Returns the per-step seconds of every window, per contender,
    in round order.
    """
    times = {name: [] for name in contenders}
    rng = np.random.default_rng(seed)
    names = list(contenders)
    for r in range(repeats):
        for i in rng.permutation(len(names)):
            times[names[i]].append(contenders[names[i]](steps) / steps)
        log(f"    round {r + 1}/{repeats}: " + ", ".join(f"{n} {times[n][-1] * 1e3:.1f} ms" for n in contenders))
    return times


def median(xs) -> float:
    return float(statistics.median(xs))


def summary(per_step: list[float], samples_per_step: int | None = None) -> dict:
    """Median, min, max step time (s) of the windows, and samples/s at the median."""
    out = {"median_step_s": median(per_step), "min_step_s": float(min(per_step)),
           "max_step_s": float(max(per_step)), "windows": len(per_step)}
    if samples_per_step:
        out["samples_per_s"] = samples_per_step / out["median_step_s"]
    return out


def paired_ratio(num: list[float], den: list[float]) -> float:
    """The median over rounds of num[r] / den[r] (windows timed back to back, so drift cancels)."""
    return median([a / b for a, b in zip(num, den)])


def ratio_spread(num: list[float], den: list[float]) -> dict:
    """The per-round ratios num[r] / den[r] and their interquartile range, to show the noise."""
    ratios = [a / b for a, b in zip(num, den)]
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    return {"per_round": ratios, "q1": float(q1), "q3": float(q3)}


class Timer:
    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0


def mlp_logits(params, x):
    import jax

    h = x
    for k, (w, b) in enumerate(params):
        h = h @ w + b
        if k < len(params) - 1:
            h = jax.nn.relu(h)
    return h


def mlp_loss(params, batch):
    """Mean softmax cross-entropy of the MLP over the examples given (jdp's loss contract)."""
    import optax

    return optax.softmax_cross_entropy_with_integer_labels(mlp_logits(params, batch["x"]), batch["y"]).mean()


def tree_bytes_per_device(tree) -> int:
    """Bytes one device holds of a pytree of (replicated or sharded) jax arrays."""
    import jax

    return int(sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree)))


def step_runner(step, sizes) -> tuple[Callable[[int], float], object, list]:
    """A compiled, warmed-up `run(n) -> seconds` of `n` calls of `step` on the benchmark MLP, alternating
    two pre-placed batches; also its initial state and the placed batches (for reports)."""
    placed = [step.shard_batch(b) for b in mlp_batches(sizes, 2)]
    first = step.init(mlp_params(sizes))
    return calls_timer(step, first, placed), first, placed


def calls_timer(step, state, placed) -> Callable[[int], float]:
    """`run(n) -> seconds` of `n` calls of `step`, from `state` on (each call's state carried to the
    next), alternating the pre-placed batches `placed`; waits for the last state before it stops the clock."""
    import jax

    box = [state]

    def run(n):
        t0 = time.perf_counter()
        for i in range(n):
            box[0], _ = step(box[0], placed[i % len(placed)])
        jax.block_until_ready(box[0])
        return time.perf_counter() - t0

    return run


def time_layouts(steps: dict, sizes, repeats: int, timed_steps: int, log=print, label: str = "") -> tuple[dict, dict]:
    """Each of `steps` ({name: a jdp step of the benchmark MLP `sizes`}) compiled, warmed up and timed
    in alternating windows of `timed_steps` steps, `repeats` rounds. Returns ({"comm_NAME": its
    collectives, NAME: its `summary`}, {NAME: per-step seconds of every window})."""
    import jdp

    runners, out = {}, {}
    for name, step in steps.items():
        run, first, placed = step_runner(step, sizes)
        out[f"comm_{name}"] = str(jdp.comm_report(step, first, placed[0]))
        run(2)  # compile and warm up
        runners[name] = run
    log(f"  part {label}: {' vs '.join(steps)}, {repeats} rounds of {timed_steps} steps")
    times = interleave(runners, timed_steps, repeats, log=log)
    for name, t in times.items():
        out[name] = summary(t, GLOBAL_BATCH)
    return out, times


def fresh_process_result(module: str, *args: str, timeout: float):
    """`python -m module ARGS` in a fresh process that sets up its own devices (`child_env`): the JSON
    of its last stdout line starting "RESULT ", or {"error": its last stderr line}."""
    env = child_env(PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=timeout)
    lines = [line for line in r.stdout.splitlines() if line.startswith("RESULT ")]
    if r.returncode or not lines:
        return {"error": (r.stderr.strip().splitlines() or ["no output"])[-1]}
    return json.loads(lines[-1][len("RESULT "):])
