"""The training loop: data -> step -> logging -> evaluation -> checkpoint, in one readable function."""
from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass

import jax

from jdp.checkpoint import Checkpointer
from jdp.config import Config, config_hash, run_identity, validate
from jdp.data import make_batches
from jdp.distributed import agree, any_process
from jdp.evaluate import evaluate, make_eval_step
from jdp.metrics import MetricsWriter, load_metrics, peak_flops, plot_metrics, step_flops
from jdp.step import get_params, make_train_step
from jdp.tasks import build_task

__all__ = ["NonFiniteError", "StopSignals", "TrainResult", "itstime", "load_metrics", "plot_metrics", "step_params",
           "train"]  # load_metrics, plot_metrics: jdp.metrics's, kept importable from here


@dataclass(frozen=True)
class TrainResult:
    """What a finished (or stopped) run reports."""

    steps: int  # optimizer steps completed, including those of earlier runs resumed from
    resumed_from: int | None  # the checkpoint step this run started from, if any
    preempted: bool  # stopped early by SIGTERM/SIGINT, with a checkpoint
    final_loss: float | None  # training loss (global-batch mean) of the last step of this run
    eval: dict  # metrics over the whole held-out set after the last step ({} without one)
    seconds: float  # wall time of this run's loop, compilation included
    params: object  # host numpy params


class NonFiniteError(RuntimeError):
    """Training stopped: too many consecutive updates had non-finite gradients."""


class StopSignals:
    """Turns SIGTERM/SIGINT into a request to stop after the current step (restored on exit)."""

    def __init__(self):
        self.requested = None

    def __enter__(self):
        self._old = {}
        with contextlib.suppress(ValueError):  # signals can only be caught on the main thread
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        self.requested = signal.Signals(signum).name

    def __exit__(self, *exc):
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


def itstime(step: int, every: int, total: int) -> bool:
    """Whether optimizer step `step` (1-based) is one to act on: every `every` steps and at the last
    step, `total`; `every=0` means only at the last. One rule for logging, evaluation and checkpoints."""
    return step == total or (every > 0 and step % every == 0)


def train(config: Config, workdir: str, *, devices=None, log=print, progress: bool = True,
          stop_after: int | None = None, tensorboard: bool = False) -> TrainResult:
    """Train `config` in `workdir`, resuming from its newest checkpoint if there is one.

    Writes `workdir/metrics.jsonl` (a JSON object per log or eval step; with `tensorboard`, also
    TensorBoard scalars) from process 0, which alone talks, and orbax checkpoints under
    `workdir/checkpoints`. `stop_after` ends this run after that many optimizer steps, with a
    checkpoint (re-running continues bit-exactly); so does SIGTERM/SIGINT on any process, at a step
    all processes agree on. Raises ValueError for an invalid config or another run's checkpoint
    before anything is written, and NonFiniteError after `train.max_nonfinite` consecutive updates
    with NaN/Inf gradients (each skipped on every device).
    """
    # Setup: devices, task, step, data, checkpoints.
    devices = _checked_devices(config, devices, workdir)
    p, t = config.parallel, config.train
    task = build_task(config)
    spec = config.optimizer_spec()  # the optax chain (schedule included) and the lr it logs
    step = make_train_step(task.loss_fn, spec, backend=p.backend, reduction=p.reduction,
                           lr_correction=p.lr_correction, devices=devices, has_aux=True, needs_rng=True,
                           has_state=True, accum_steps=p.accum_steps, accum_sync=p.accum_sync,
                           skip_nonfinite=t.max_nonfinite > 0)
    # Every process must be about to run the same thing (config, data, length) before any step.
    agree({"config": config_hash(config), "train_examples": len(task.train), "steps": t.steps,
           "devices": len(devices)})
    batches = make_batches(task.train, config.data.batch_size, seed=t.seed, drop_last=config.data.drop_last,
                           process_index=jax.process_index(), num_processes=jax.process_count())
    state = step.init(task.params, task.model_state, seed=t.seed)
    run = {"identity": run_identity(config), "config": config.to_dict(), "devices": len(devices)}
    checkpoints = Checkpointer(os.path.join(workdir, "checkpoints"), keep=t.keep_checkpoints)
    eval_step = make_eval_step(task.metric_fn, step.mesh) if task.test is not None else None

    # Resume: the newest complete checkpoint, if any (refused, untouched, if from another run).
    state, resumed_from = _resume(checkpoints, step, state, batches, run, log)
    start = resumed_from or 0
    end = t.steps if stop_after is None else min(t.steps, start + stop_after)
    os.makedirs(workdir, exist_ok=True)
    writer = MetricsWriter(workdir, total=t.steps, start=start, log=log, progress=progress, tensorboard=tensorboard,
                           active=jax.process_index() == 0)  # all processes checkpoint; process 0 alone writes
    writer.log(_describe(task, config, devices, start, end))

    # The loop. The only host syncs are at log and eval steps.
    throughput, final_loss, eval_metrics, preempted = _Throughput(start), None, {}, False
    peak = (peak_flops(devices[0].device_kind) or 0.0) * len(devices)  # all devices' peak FLOP/s; 0: unknown
    # One process alone decides nothing: the stop request is all-gathered every `check_every` steps.
    check_every = 1 if jax.process_count() == 1 else max(1, min(t.log_every, 10))
    t0 = time.perf_counter()
    with contextlib.ExitStack() as cleanup, StopSignals() as signals:
        # Close files and wait for the last checkpoint write even when a step raises.
        cleanup.callback(batches.close)
        cleanup.callback(checkpoints.close)
        cleanup.enter_context(writer)
        for s in range(start + 1, end + 1):
            # Train: one optimizer step, `accum_steps` calls.
            for micro in step.micro_batches(next(batches)):
                state, metrics = step(state, micro)
            writer.advance()
            if s == start + 1:  # once compiled: the step's FLOPs, per optimizer step, all devices
                flops_per_step = step_flops(step, state, micro)

            # Log and evaluate.
            record = {"step": s}
            if itstime(s, t.log_every, end):
                m = jax.device_get(metrics)
                _check_finite(s, m, t.max_nonfinite)
                record |= _train_record(m, state, lr=spec.learning_rate(s - 1), samples=config.data.batch_size,
                                        steps_per_s=throughput(s), flops_per_step=flops_per_step, peak=peak)
                final_loss = record["loss"]
            if eval_step is not None and itstime(s, t.eval_every, end):
                eval_metrics = evaluate(eval_step, *step_params(step, state), task.test,
                                        config.data.eval_batch_size, step.mesh)
                record |= {f"eval_{k}": v for k, v in eval_metrics.items()}
            writer.write(record)

            # Checkpoint, and stop here if any process was asked to: all stop at the same step.
            stop = s % check_every == 0 and any_process(signals.requested is not None)
            if itstime(s, t.checkpoint_every, end) or stop:
                checkpoints.save(s, step, state, batches.get_state(), run)
            if stop:
                writer.log(f"stopping at step {s} on {signals.requested or 'a peer process signal'}; checkpoint "
                           f"saved, rerun the same command to resume.")
                preempted, end = True, s
                break

    seconds = time.perf_counter() - t0
    return TrainResult(end, resumed_from, preempted, final_loss, eval_metrics, seconds, get_params(state))


def _resume(checkpoints: Checkpointer, step, state, batches, run: dict, log) -> tuple:
    """(state, its step) from the newest complete checkpoint, with the data position restored;
    (state, None) without one. Another run's checkpoint is refused and left untouched."""
    if checkpoints.latest_step() is None:
        return state, None
    state, data_state, resumed_from = checkpoints.restore(step, state, run)
    batches.set_state(data_state)
    log(f"resumed from step {resumed_from} in {checkpoints.directory}")  # every process restores, and says so
    return state, resumed_from


def _checked_devices(config: Config, devices, workdir: str) -> list:
    """The devices to train on (the config's count of the given ones, default all), config and
    workdir checked against them before anything is written."""
    devices = list(devices or jax.devices())
    if config.parallel.devices:
        devices = devices[:config.parallel.devices]
    validate(config, len(devices))
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise ValueError(f"--workdir {workdir!r} exists and is not a directory.")
    return devices


def _describe(task, config: Config, devices, start: int, end: int) -> str:
    """The run's first console line: what, how far, on what, and how the global batch splits."""
    p, n, batch = config.parallel, len(devices), config.data.batch_size
    return (f"{task.description}: {start} -> {end} of {config.train.steps} steps on {n} {devices[0].platform} "
            f"device(s), global batch {batch} = {p.accum_steps} × {n} × {batch // (p.accum_steps * n)}, "
            f"{p.backend}, reduction {p.reduction}")


class _Throughput:
    """Optimizer steps per second since the previous log step (the first interval includes compilation)."""

    def __init__(self, step: int):
        self.step, self.time = step, time.perf_counter()

    def __call__(self, step: int) -> float:
        now = time.perf_counter()
        rate = (step - self.step) / (now - self.time)
        self.step, self.time = step, now
        return rate


def _check_finite(s: int, m: dict, max_nonfinite: int) -> None:
    """Raise NonFiniteError once `max_nonfinite` updates in a row were skipped (0: never)."""
    if max_nonfinite and int(m["skip_streak"]) >= max_nonfinite:
        raise NonFiniteError(f"training stopped at step {s}: the last {int(m['skip_streak'])} updates had "
                             f"non-finite gradients (train.max_nonfinite={max_nonfinite}); the newest checkpoint "
                             f"is from before them.")


def _train_record(m: dict, state, *, lr: float, samples: int, steps_per_s: float, flops_per_step: float | None,
                  peak: float) -> dict:
    """A log step's training metrics from the step's host metrics `m`: loss, gradient norm, learning
    rate, throughput, the aux metrics as train_*, FLOP/s and MFU where known (`peak`: all devices'
    peak FLOP/s, 0 if unknown), and the count of skipped updates once any update was skipped."""
    record = {"loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]), "lr": lr,
              "samples_per_s": steps_per_s * samples, **{f"train_{k}": float(v) for k, v in m["aux"].items()}}
    if flops_per_step:
        record["flops_per_s"] = steps_per_s * flops_per_step
        if peak:
            record["mfu"] = record["flops_per_s"] / peak
    if m["skipped"]:
        record["skipped_total"] = int(jax.device_get(state.skipped).reshape(-1)[0])
    return record


def step_params(step, state):
    """(params, model_state) as one replicated copy, for evaluation."""
    canonical = step.canonical(state)
    return canonical.params, canonical.model_state


