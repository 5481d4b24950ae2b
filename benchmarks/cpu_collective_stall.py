"""Does XLA's in-process CPU all-reduce stall? Count aborted runs, each in a fresh process.

XLA's CPU all-reduce on fake host devices can deadlock and abort the process after 40 s
("Expected 2 threads to join the rendezvous ... Termination timeout"); see docs/cpu-devices.md. This runs
a training step of an MLP 784-1024-1024-10 (global batch 256, Adam, 45 steps) many times and
counts the aborts, for two subjects:

  reproducer  a hand-written `jax.jit(jax.shard_map(...))` step, the script `REPRODUCER` below
              (host numpy batches, async dispatch);
  jdp         `jdp.make_train_step` on the same model and data.

under two thread-pool settings (`--pools`): `xla`, XLA's default of max(cores, N) threads (what
a process gets without jdp), and `jdp`, what `jdp.cpu` sets (2N + 2 threads); and, for jdp's
step, with and without its bound on steps in flight (`--bound on|off`).

Usage (the before/after table in docs/cpu-devices.md):
  python -m benchmarks.cpu_collective_stall --trials 20
  python -m benchmarks.cpu_collective_stall --subject jdp --pools xla --bound off --devices 4
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap
import time

from benchmarks.common import child_env

MODEL = textwrap.dedent('''
    import sys, time
    import numpy as np
    devices, pools, bound = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "on"
    sizes, B, STEPS = [784, 1024, 1024, 10], 256, 45
    rng = np.random.default_rng(0)
    params = [(rng.normal(0, 1 / np.sqrt(i), (i, o)).astype(np.float32), np.zeros(o, np.float32))
              for i, o in zip(sizes[:-1], sizes[1:])]
    X = rng.normal(size=(B * 8, sizes[0])).astype(np.float32)
    Y = rng.integers(0, 10, B * 8).astype(np.int32)
''')

REPRODUCER = MODEL + textwrap.dedent('''
    import jax, jax.numpy as jnp, optax
    if pools == "jdp":
        import jdp.cpu
        jdp.cpu.use_cpu_devices(devices)
    else:
        jax.config.update("jax_num_cpu_devices", devices)
    from jax.sharding import Mesh, PartitionSpec as P
    def loss_fn(ps, x, y):
        h = x
        for k, (w, b) in enumerate(ps):
            h = h @ w + b
            if k < len(ps) - 1: h = jax.nn.relu(h)
        return optax.softmax_cross_entropy_with_integer_labels(h, y).mean()
    tx = optax.adam(1e-3)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    def step(ps, o, x, y):
        g = jax.lax.pmean(jax.grad(loss_fn)(ps, x, y), "data")
        u, o = tx.update(g, o, ps)
        return optax.apply_updates(ps, u), o
    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")),
                              out_specs=(P(), P()), check_vma=False))
    ps = jax.tree.map(jnp.asarray, params); o = tx.init(ps)
    t0 = time.perf_counter()
    for s in range(STEPS):
        ps, o = f(ps, o, X[(s % 8) * B:(s % 8 + 1) * B], Y[(s % 8) * B:(s % 8 + 1) * B])
    jax.block_until_ready(ps)
    print("STEP_SECONDS", time.perf_counter() - t0)
''')

JDP = MODEL + textwrap.dedent('''
    import jdp, jdp.cpu
    jdp.cpu.use_cpu_devices(devices)
    import jax, optax
    def loss_fn(ps, batch):
        h = batch["x"]
        for k, (w, b) in enumerate(ps):
            h = h @ w + b
            if k < len(ps) - 1: h = jax.nn.relu(h)
        return optax.softmax_cross_entropy_with_integer_labels(h, batch["y"]).mean()
    step = jdp.make_train_step(loss_fn, optax.adam(1e-3))
    if not bound:
        step.run_ahead.limit = None
    state = step.init(params)
    t0 = time.perf_counter()
    for s in range(STEPS):
        state, _ = step(state, {"x": X[(s % 8) * B:(s % 8 + 1) * B], "y": Y[(s % 8) * B:(s % 8 + 1) * B]})
    jax.block_until_ready(state)
    print("STEP_SECONDS", time.perf_counter() - t0)
''')


def run_trials(subject: str, pools: str, bound: str, devices: int, trials: int, timeout: float = 240.0) -> dict:
    """Run `trials` fresh processes; returns counts of aborts and the median loop time of the rest."""
    env = child_env("JDP_CPU_THREADS")
    if pools == "xla":
        env["JDP_CPU_THREADS"] = "xla"  # jdp leaves XLA's default pools alone
    code = {"reproducer": REPRODUCER, "jdp": JDP}[subject]
    aborted, hung, seconds = 0, 0, []
    for t in range(trials):
        start = time.perf_counter()
        try:
            r = subprocess.run([sys.executable, "-c", code, str(devices), pools, bound], capture_output=True,
                               text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            hung += 1
            print(f"  trial {t + 1}: HUNG past {timeout:.0f} s", flush=True)
            continue
        if r.returncode != 0:
            aborted += 1
            why = "rendezvous stall" if "rendezvous" in r.stderr else r.stderr.strip().splitlines()[-1:]
            print(f"  trial {t + 1}: ABORTED rc={r.returncode} after {time.perf_counter() - start:.0f} s ({why})",
                  flush=True)
        else:
            seconds.append(float(r.stdout.split("STEP_SECONDS")[1]))
            print(f"  trial {t + 1}: ok, 45 steps in {seconds[-1]:.2f} s", flush=True)
    seconds.sort()
    return {"subject": subject, "pools": pools, "bound": bound if subject == "jdp" else "-", "devices": devices,
            "trials": trials, "aborted": aborted,
            "hung": hung, "median_loop_s": seconds[len(seconds) // 2] if seconds else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--subject", choices=("reproducer", "jdp"), action="append")
    p.add_argument("--pools", choices=("xla", "jdp"), action="append")
    p.add_argument("--bound", choices=("on", "off"), action="append", help="jdp's step only")
    p.add_argument("--devices", type=int, action="append")
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--json", help="append one JSON line per configuration to this file")
    a = p.parse_args(argv)
    configs = [(subject, pools, bound, devices)
               for subject in a.subject or ["reproducer", "jdp"]
               for pools in a.pools or ["xla", "jdp"]
               for bound in (a.bound or ["off", "on"] if subject == "jdp" else ["-"])
               for devices in a.devices or [2]]
    for subject, pools, bound, devices in configs:
        print(f"{subject}, pools {pools}, bound {bound}, {devices} devices, {a.trials} trials", flush=True)
        res = run_trials(subject, pools, bound, devices, a.trials)
        print(f"RESULT {json.dumps(res)}", flush=True)
        if a.json:
            with open(a.json, "a") as f:
                f.write(json.dumps(res) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
