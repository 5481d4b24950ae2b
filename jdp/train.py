"""The training loop: data -> step -> logging -> evaluation -> checkpoint, in one readable function."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from dataclasses import dataclass

import jax
import numpy as np

from jdp.checkpoint import Checkpointer
from jdp.config import Config, build_optimizer, config_hash, run_identity, validate
from jdp.data import make_batches
from jdp.distributed import agree, any_process
from jdp.evaluate import evaluate, make_eval_step
from jdp.step import get_params, make_train_step
from jdp.tasks import build_task

# Peak dense bf16 FLOP/s per device, for MFU; devices not listed get achieved FLOP/s only.
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}


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


def peak_flops(device) -> float | None:
    kind = getattr(device, "device_kind", "")
    return next((v for k, v in PEAK_FLOPS.items() if k in kind), None)


def _progress(enabled: bool, total: int, start: int):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    bar = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                   TimeRemainingColumn(), disable=not enabled)
    return bar, bar.add_task("", total=total, completed=start)


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


class TensorBoard:
    """Scalars to TensorBoard event files under `workdir/tensorboard` (needs tensorboardX)."""

    def __init__(self, workdir: str):
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise ValueError("--tensorboard needs tensorboardX: pip install 'jdp[tensorboard]'.") from None
        self._writer = SummaryWriter(os.path.join(workdir, "tensorboard"))

    def write(self, record: dict) -> None:
        for key, value in record.items():
            if key != "step":
                self._writer.add_scalar(key, value, record["step"])
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def train(config: Config, workdir: str, *, devices=None, log=print, progress: bool = True,
          stop_after: int | None = None, tensorboard: bool = False) -> TrainResult:
    """Train `config` in `workdir`, resuming from its newest checkpoint if there is one.

    Writes `workdir/metrics.jsonl` (one JSON object per logged step; with `tensorboard`, the same
    scalars under `workdir/tensorboard`) and orbax checkpoints under `workdir/checkpoints`. `stop_after` ends this run, with a checkpoint, after that many optimizer
    steps (re-running continues bit-exactly); so does SIGTERM/SIGINT on any process, at a step all
    processes agree on. Raises ValueError for an invalid config or a checkpoint written by a
    different run, before anything is written, and NonFiniteError after `train.max_nonfinite`
    consecutive updates with NaN/Inf gradients (each skipped on every device).
    """
    # Setup: devices, task, step, data, checkpoints.
    devices = list(devices or jax.devices())
    if config.parallel.devices:
        devices = devices[:config.parallel.devices]
    validate(config, len(devices))
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise ValueError(f"--workdir {workdir!r} exists and is not a directory.")
    p, t = config.parallel, config.train
    task = build_task(config)
    optimizer, lr_at, lr_correction = build_optimizer(config, len(devices))
    # Skipping needs the update in one place: not MultiSteps' accumulate-every-call mode.
    max_nonfinite = 0 if (p.accum_steps > 1 and p.accum_sync == "every") else t.max_nonfinite
    step = make_train_step(task.loss_fn, optimizer, backend=p.backend, reduction=p.reduction,
                           lr_correction=lr_correction, devices=devices, has_aux=True, needs_rng=True,
                           has_state=True, accum_steps=p.accum_steps, accum_sync=p.accum_sync,
                           skip_nonfinite=max_nonfinite > 0)
    # Every process must be about to run the same thing (config, data, length) before any step.
    agree({"config": config_hash(config), "train_examples": len(task.train), "steps": t.steps,
           "devices": len(devices)})
    primary = jax.process_index() == 0  # writes metrics and talks; all processes checkpoint
    batches = make_batches(task.train, config.data.batch_size, seed=t.seed, drop_last=config.data.drop_last,
                           process_index=jax.process_index(), num_processes=jax.process_count())
    micro = config.data.batch_size // p.accum_steps  # an example micro-batch sizes the aux accumulator
    state = step.init(task.params, task.model_state, seed=t.seed,
                      example_batch={k: v[:micro] for k, v in task.train.arrays.items()})
    run = {"identity": run_identity(config), "config": config.to_dict(), "devices": len(devices)}
    checkpoints = Checkpointer(os.path.join(workdir, "checkpoints"), keep=t.keep_checkpoints)
    eval_step = make_eval_step(task.metric_fn, step.mesh) if task.test is not None else None

    # Resume: the newest complete checkpoint, if any (refused, untouched, if from another run).
    start = resumed_from = None
    if checkpoints.latest_step() is not None:
        state, data_state, resumed_from = checkpoints.restore(step, state, run)
        batches.set_state(data_state)
        log(f"resumed from step {resumed_from} in {checkpoints.directory}")
    start = resumed_from or 0
    end = t.steps if stop_after is None else min(t.steps, start + stop_after)
    os.makedirs(workdir, exist_ok=True)
    metrics_file = open(os.path.join(workdir, "metrics.jsonl"), "a") if primary else open(os.devnull, "w")
    log = log if primary else (lambda *_: None)
    log(f"{task.description}: {start} -> {end} of {t.steps} steps on {len(devices)} {devices[0].platform} "
        f"device(s), global batch {config.data.batch_size} = {p.accum_steps} × {len(devices)} × "
        f"{config.data.batch_size // (p.accum_steps * len(devices))}, {p.backend}, reduction {p.reduction}")

    # The loop. The only host syncs are at log and eval steps.
    bar, bar_task = _progress(progress and primary, t.steps, start)
    flops_per_step = peak = None
    last_log_time, last_log_step, final_loss, eval_metrics = time.perf_counter(), start, None, {}
    # One process alone decides nothing: the stop request is all-gathered every `check_every` steps.
    check_every = 1 if jax.process_count() == 1 else max(1, min(t.log_every, 10))
    preempted = False
    t0 = time.perf_counter()
    with contextlib.ExitStack() as cleanup, bar, StopSignals() as signals:
        # Close files and wait for the last checkpoint write even when a step raises.
        cleanup.callback(batches.close)
        cleanup.callback(checkpoints.close)
        cleanup.enter_context(metrics_file)
        board = TensorBoard(workdir) if tensorboard and primary else None
        if board is not None:
            cleanup.callback(board.close)
        for s in range(start + 1, end + 1):
            for micro in step.micro_batches(next(batches)):
                state, metrics = step(state, micro)
            bar.advance(bar_task)
            if flops_per_step is None:  # once: the compiled step's FLOPs, per optimizer step, all devices
                flops_per_step = _step_flops(step, state, micro)
                peak = peak_flops(devices[0])

            if s % t.log_every == 0 or s == end:
                m = jax.device_get(metrics)
                now = time.perf_counter()
                rate = (s - last_log_step) / (now - last_log_time)
                record = {"step": s, "loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]),
                          "lr": lr_at(s - 1), "samples_per_s": rate * config.data.batch_size,
                          **{f"train_{k}": float(v) for k, v in m["aux"].items()}}
                if flops_per_step:
                    record["flops_per_s"] = rate * flops_per_step
                    if peak:
                        record["mfu"] = record["flops_per_s"] / (peak * len(devices))
                final_loss, last_log_time, last_log_step = record["loss"], now, s
                if max_nonfinite and int(m["skip_streak"]) >= max_nonfinite:
                    raise NonFiniteError(f"training stopped at step {s}: the last {int(m['skip_streak'])} updates "
                                         f"had non-finite gradients (train.max_nonfinite={max_nonfinite}); the "
                                         f"newest checkpoint is from before them.")
                if m["skipped"]:
                    record["skipped_total"] = int(jax.device_get(state.skipped).reshape(-1)[0])
                bar.update(bar_task, description=f"loss {record['loss']:.4f}  {record['samples_per_s']:,.0f} samples/s")
                if not progress:
                    log(f"step {s:6d}  loss {record['loss']:.4f}  grad_norm {record['grad_norm']:.3f}  "
                        f"lr {record['lr']:.2e}  {record['samples_per_s']:,.0f} samples/s")
            else:
                record = None

            if eval_step is not None and ((t.eval_every and s % t.eval_every == 0) or s == end):
                eval_metrics = evaluate(eval_step, *step_params(step, state), task.test,
                                        config.data.eval_batch_size, step.mesh)
                record = (record or {"step": s}) | {f"eval_{k}": v for k, v in eval_metrics.items()}
                log(f"step {s:6d}  eval " + "  ".join(f"{k} {v:.4f}" for k, v in eval_metrics.items()))
            if record is not None:
                metrics_file.write(json.dumps(record) + "\n")
                metrics_file.flush()
                if board is not None:
                    board.write(record)

            stop = s % check_every == 0 and any_process(signals.requested is not None)
            if (t.checkpoint_every and s % t.checkpoint_every == 0) or s == end or stop:
                checkpoints.save(s, step, state, batches.get_state(), run)
            if stop:
                log(f"stopping at step {s} on {signals.requested or 'a peer process signal'}; checkpoint saved, "
                    f"rerun the same command to resume.")
                preempted, end = True, s
                break

    seconds = time.perf_counter() - t0
    return TrainResult(end, resumed_from, preempted, final_loss, eval_metrics, seconds, get_params(state))


def step_params(step, state):
    """(params, model_state) as one replicated copy, for evaluation."""
    canonical = step.canonical(state)
    return canonical.params, canonical.model_state


def _step_flops(step, state, micro) -> float | None:
    """FLOPs of one optimizer step over all devices, from XLA's cost analysis of the compiled step."""
    try:
        cost = step.lower(state, micro).compile().cost_analysis()
    except Exception:  # cost analysis is best-effort: some backends do not provide it
        return None
    cost = cost[0] if isinstance(cost, list) else cost
    flops = float((cost or {}).get("flops", 0.0))
    return flops * step.num_devices * step.accum_steps if flops > 0 else None


def load_metrics(workdir: str) -> list[dict]:
    """The records of `workdir/metrics.jsonl`, in order."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ValueError(f"{path!r} does not exist; run `jdp train ... --workdir {workdir}` first.")
    records = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path!r} line {number} is not JSON ({e.msg}); remove or repair that line.") from None
            if not isinstance(record, dict) or "step" not in record:
                raise ValueError(f"{path!r} line {number} is not a metrics record (a JSON object with a 'step').")
            records.append(record)
    return records


def plot_metrics(workdir: str, path: str | None = None) -> str:
    """Save a PNG of the loss (train, eval) and accuracy curves of a run; returns its path."""
    records = load_metrics(workdir)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("jdp plot needs matplotlib: pip install 'jdp[plot]'.") from None
    path = path or os.path.join(workdir, "curves.png")
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 3.6))
    for key, ax in (("loss", ax_loss), ("train_accuracy", ax_acc), ("eval_loss", ax_loss), ("eval_accuracy", ax_acc)):
        pts = [(r["step"], r[key]) for r in records if key in r]
        if pts:
            ax.plot(*np.array(pts).T, marker="o" if key.startswith("eval") else None, label=key)
    for ax, title in ((ax_loss, "loss"), (ax_acc, "accuracy")):
        ax.set(title=title, xlabel="optimizer step")
        if ax.lines:
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
