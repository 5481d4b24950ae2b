"""What the first-call audit (`jdp.core.audit`) costs: the first step with and without it.

  python -m benchmarks.audit_cost              # digits MLP and char GPT, 4 fake CPU devices, 3 rounds

For each shipped config (the trainer's own task, whose losses are masked means or `jdp.Weighted`,
which the audit only traces) and for the same model with a plain mean loss (which it compiles and
runs), a fresh step is built and its first call timed (compile and run, no persistent cache),
with audit=True and audit=False alternately; the report gives the medians and the audit's own time
(`step.audit` on a fresh step).
"""
from __future__ import annotations

import os
import statistics
import time

import jdp

jdp.cpu.use_cpu_devices(4)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jdp.run.config import load_config  # noqa: E402
from jdp.run.tasks import build_task  # noqa: E402

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(jdp.__file__)), "configs")


def plain(loss_fn):
    """A weighted task loss as a plain mean: its per-token sum over every position of the rows."""
    def loss(params, model_state, batch, rng):
        value, (_, state) = loss_fn(params, model_state, batch, rng)
        return value.total / np.prod(batch["y"].shape), ({}, state)
    return loss


def first_call(config, loss, task, batch, audit: bool) -> float:
    """Seconds of the first call (compile and run) of a fresh step."""
    step = jdp.make_train_step(loss, config.optimizer_spec(), has_aux=True, needs_rng=True, has_state=True,
                               audit=audit)
    state = step.init(task.params, task.model_state)
    t = time.perf_counter()
    jax.block_until_ready(step(state, batch)[1])
    return time.perf_counter() - t


def audit_alone(config, loss, task, batch) -> float:
    step = jdp.make_train_step(loss, config.optimizer_spec(), has_aux=True, needs_rng=True, has_state=True)
    state = step.init(task.params, task.model_state)
    t = time.perf_counter()
    step.audit(state, batch)
    return time.perf_counter() - t


def main(rounds: int = 3) -> None:
    for name, label in (("digits_mlp", "its loss, a plain mean"), ("char_gpt", "its loss, jdp.Weighted"),
                        ("char_gpt", "a plain mean loss")):
        config = load_config(os.path.join(CONFIGS, f"{name}.yaml"))
        task = build_task(config)
        loss = plain(task.loss_fn) if label == "a plain mean loss" else task.loss_fn
        rows = [task.train[i] for i in range(config.data.batch_size)]
        batch = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
        on, off, own = [], [], []
        for _ in range(rounds):
            off.append(first_call(config, loss, task, batch, False))
            on.append(first_call(config, loss, task, batch, True))
            own.append(audit_alone(config, loss, task, batch))
        med = statistics.median
        print(f"{name}, {label}: first call {med(off):.2f} s without the audit, {med(on):.2f} s with it "
              f"(+{med(on) - med(off):.2f} s, {med(on) / med(off) - 1:+.0%}); step.audit alone {med(own):.2f} s "
              f"(medians of {rounds}, {jax.device_count()} devices)")


if __name__ == "__main__":
    main()
