"""The training loop: data -> step -> logging -> evaluation -> checkpoint, in one readable function."""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from dataclasses import dataclass

import jax

from jdp.bridges.task import Task
from jdp.core.evaluate import evaluate, make_eval_step
from jdp.core.step import get_params
from jdp.data import make_batches
from jdp.inspect.memory import memory_report
from jdp.run.checkpoint import CheckpointMismatchError, Checkpointer
from jdp.run.config import Config, validate
from jdp.run.device_defaults import resolve_device_defaults
from jdp.run.distributed import agree, any_process
from jdp.run.facts import RunFacts, itstime
from jdp.run.lock import locked_workdir
from jdp.run.memory_table import compiled_peak
from jdp.run.metrics import MetricsWriter, flops_line, load_metrics, peak_flops, plot_metrics, step_model_flops
from jdp.run.profile import StepProfile, parse_steps
from jdp.run.records import (DataStoppedError, EvaluationOutOfMemoryError, NonFiniteError, Throughput, check_finite,
                              evaluation_out_of_memory, language_model_units, stopping_line, train_record,
                              unreadable_batch)
from jdp.run.tasks import build_task, train_step_for
from jdp.run.workfiles import MadeByRun, refuse_symlink

# load_metrics, plot_metrics: jdp.run.metrics's, kept importable from here
__all__ = ["DataStoppedError", "EvaluationOutOfMemoryError", "NonFiniteError", "StopSignals", "TrainResult", "itstime", "load_metrics", "meant_for_accelerators",
           "plot_metrics", "schedule_facts", "step_params", "train"]


@dataclass(frozen=True)
class TrainResult:
    """What a finished (or stopped) run reports."""

    steps: int  # optimizer steps completed, including those of earlier runs resumed from
    resumed_from: int | None  # the checkpoint step this run started from, if any
    preempted: bool  # stopped early by SIGTERM/SIGINT, with a checkpoint
    final_loss: float | None  # training loss (global-batch mean) of the last step of this run
    eval: dict  # metrics over the whole held-out set after the last step, also when the run was already
    # complete (then of the restored state); {} without a held-out set or when stopped before any
    seconds: float  # wall time of this run's loop, compilation included
    params: object  # host numpy params
    stopped_by: str | None = None  # the signal that stopped it early ("SIGINT", "SIGTERM"), if one did


class StopSignals:
    """Turns SIGTERM/SIGINT into a request to stop after the current step (restored on exit).

    Every signal while inside only records the request: a second one during a checkpoint write
    does not abort it.
    """

    def __init__(self):
        self.requested = None
        self.checkpointed = False  # set once the stop's checkpoint is on disk: later signals then exit 0

    def __enter__(self):
        self._old = {}
        with contextlib.suppress(ValueError):  # signals can only be caught on the main thread
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        self.requested = self.requested or signal.Signals(signum).name  # the first one is the reason

    def __exit__(self, *exc):
        # After a stop whose checkpoint is on disk, the job has succeeded: a signal during the
        # teardown that follows (a scheduler repeating SIGTERM) ends the process with exit code 0
        # where it would otherwise have killed it (-15) or raised KeyboardInterrupt.
        for sig, handler in self._old.items():
            dies = handler in (signal.SIG_DFL, signal.default_int_handler)
            signal.signal(sig, _exit_zero if self.checkpointed and dies else handler)


def _exit_zero(signum, frame):
    """A signal after a stop's checkpoint was saved: flush what was printed and exit 0 at once."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


def train(config: Config, workdir: str, *, devices=None, log=print, progress: bool = True,
          stop_after: int | None = None, tensorboard: bool = False, fallback_to_intact: bool = False,
          task: Task | None = None, allow_cpu: bool = False, wandb: bool = False) -> TrainResult:
    """Train `config` in `workdir`, resuming from its newest checkpoint if there is one.

    `task`: your own model, loss and arrays (`jdp.nnx.task(...)`) instead of the config's model
    and data sections.

    The step computes in train.precision (bfloat16: forward and backward in bf16 on float32 master
    params; jdp's models, and so the evaluation, compute in it too) and all-reduces the gradient in
    parallel.reduce_dtype. A config with train.accelerator_only is refused (ValueError) when the
    devices are CPUs, unless `allow_cpu=True`, which trains on them anyway and logs one line saying so.

    Writes `workdir/metrics.jsonl` (a JSON object per log or eval step, and the first step's time,
    compilation included, as `compile_s`, which `samples_per_s` leaves out; with `tensorboard`, also
    TensorBoard scalars; with `wandb`, a W&B offline run: `jdp.run.trackers`) from process 0, which
    alone talks, a `jax.profiler` trace of the steps train.profile_steps names (`jdp.run.profile`), and orbax checkpoints under
    `workdir/checkpoints`. `stop_after` ends this run after that many optimizer steps, with a
    checkpoint (re-running continues bit-exactly); so does SIGTERM/SIGINT on any process, at a step
    all processes agree on. The run holds `workdir` (`jdp.run.lock`) and handles SIGTERM/SIGINT until
    every checkpoint write has finished; the last checkpoint is written and awaited before the
    final evaluation, and a failing evaluation or metrics write checkpoints its step first (one
    process), so neither costs trained steps; a batch that cannot be read once training has started
    (a token file changed under the run, an id ≥ vocab_size found late) checkpoints the step before
    it and raises DataStoppedError. A run already complete trains nothing and evaluates
    the restored state. Raises ValueError for an invalid config, a workdir another live run holds,
    another run's checkpoint (train.steps counts only where the schedule uses it) or one past
    train.steps, before anything is written, and NonFiniteError after `train.max_nonfinite`
    consecutive updates with NaN/Inf gradients (each skipped on every device). A damaged newest
    checkpoint is refused (ValueError) unless `fallback_to_intact`, which resumes from the newest
    intact one; a state holding NaN/Inf is never checkpointed (`jdp.run.checkpoint.NonFiniteStateError`).
    A run that fails before its first record or checkpoint (as the step compiles) removes what it made
    and left empty: checkpoints/, metrics.jsonl and the workdir (`jdp.run.workfiles.MadeByRun`).
    """
    if not workdir:
        raise ValueError("--workdir '' is empty; name the run's directory (or leave --workdir out for "
                         "runs/<config name>).")
    facts = RunFacts.of(config, devices, stop_after=stop_after, fallback_to_intact=fallback_to_intact)
    # Every process must take the same collectives at the same steps: agree on what decides them
    # (and on the run) before the steps touch the devices.
    agree(facts.agreed)
    devices = _checked_devices(config, devices, workdir, allow_cpu, log)
    # model.attention / model.remat "auto": chosen for these devices and said, before the run's identity;
    # processes on different kinds of device could choose differently, so they agree once more
    resolved = resolve_device_defaults(config, devices, compiled_peak, log)
    if resolved is not config:
        config = resolved
        facts = RunFacts.of(config, devices, stop_after=stop_after, fallback_to_intact=fallback_to_intact)
        agree(facts.agreed)
    paths = (None, None) if task else (config.data.path, config.data.val_path)
    parts = _Parts.build(config, task or build_task(config), devices, facts, paths)
    # A run that fails before it writes a record or checkpoint takes back the empty workdir and files it made.
    made = MadeByRun(workdir, active=jax.process_index() == 0)
    with made.dirs_on_failure(), StopSignals() as signals, locked_workdir(workdir, log), made.files_on_failure(), \
            contextlib.ExitStack() as cleanup:
        # Exits in reverse order: files closed and the last checkpoint write awaited, then the workdir
        # released, all while the signals are still handled (a SIGTERM then cannot kill the write).
        cleanup.callback(parts.batches.close)
        refuse_symlink(os.path.join(workdir, "checkpoints"), "the checkpoint directory")
        checkpoints = Checkpointer(os.path.join(workdir, "checkpoints"), keep=config.train.keep_checkpoints)
        cleanup.callback(checkpoints.close)
        # Resume: the newest complete checkpoint, if any (refused, untouched, if from another run).
        state, resumed_from = _resume(checkpoints, parts, log, fallback_to_intact)
        start = resumed_from or 0
        end = facts.steps if stop_after is None else min(facts.steps, start + stop_after)
        writer = MetricsWriter(workdir, total=facts.steps, start=start, log=log, progress=progress,
                               tensorboard=tensorboard, active=jax.process_index() == 0,  # process 0 alone writes
                               tracker=_tracker(wandb, workdir, config, parts.facts, devices))
        writer.log(_describe(parts.task, config, devices, start, end))
        cleanup.enter_context(writer)
        profile = StepProfile(parse_steps(config.train.profile_steps), workdir, writer.log)
        cleanup.callback(profile.stop)  # a run that stops inside the range keeps what it traced
        loop = _Loop(config, parts, checkpoints, writer, signals, devices, profile)
        t0 = time.perf_counter()
        state, end = loop.run(state, start, end)
    return TrainResult(end, resumed_from, loop.preempted, loop.final_loss, loop.eval_metrics,
                       time.perf_counter() - t0, get_params(state), signals.requested if loop.preempted else None)


@dataclass(frozen=True)
class _Parts:
    """What one invocation trains with: the task, its step and optimizer spec, the batches, the first
    state, the evaluation step and the run's facts (with its data's digest)."""

    task: Task
    spec: object  # the optax chain (schedule included) and the lr it logs
    step: object
    batches: object
    state: object
    eval_step: object  # None without a held-out set
    facts: RunFacts

    @classmethod
    def build(cls, config: Config, task: Task, devices: list, facts: RunFacts, paths: tuple = (None, None)) -> _Parts:
        """`paths`: the training and held-out files the task was read from, if any (named on a disagreement)."""
        t, d = config.train, config.data
        spec = config.optimizer_spec()
        step = train_step_for(config, task, devices)
        # ... and on the data each builds (a file that differs between hosts): the training set decides
        # the batches, the held-out set how many evaluation batches reduce over the devices.
        facts = facts.with_data(task.train, task.test, paths=paths)
        agree(facts.data_facts())
        batches = make_batches(task.train, d.batch_size, seed=t.seed, drop_last=d.drop_last, threads=d.threads,
                               workers=d.workers, transform=task.transform, process_index=jax.process_index(),
                               num_processes=jax.process_count())
        state = step.init(task.params, task.model_state, seed=t.seed)
        eval_step = make_eval_step(task.metric_fn, step.mesh) if task.test is not None else None
        return cls(task, spec, step, batches, state, eval_step, facts)


class _Loop:
    """The training loop of one invocation: step, log, checkpoint, evaluate; the only host syncs are
    at log and eval steps."""

    def __init__(self, config, parts: _Parts, checkpoints, writer, signals, devices, profile=None):
        self.config, self.spec, self.step, self.task, self.eval_step = (config, parts.spec, parts.step, parts.task,
                                                                        parts.eval_step)
        self.facts, self.batches, self.checkpoints, self.writer, self.signals = (parts.facts, parts.batches,
                                                                                 checkpoints, writer, signals)
        self.run_info = parts.facts.checkpoint_run()
        self.kind, self.dtype, self.on_cpu = devices[0].device_kind, config.train.precision, devices[0].platform == "cpu"
        self.peak_each = peak_flops(self.kind, self.dtype)  # None: unknown (a CPU's: never said to be missing)
        self.peak = (self.peak_each or 0.0) * len(devices)  # all devices' peak; 0: unknown
        # One process alone decides nothing: the stop request is all-gathered every `check_every` steps.
        self.check_every = parts.facts.stop_check_every(jax.process_count())
        self.final_loss, self.eval_metrics, self.preempted, self.saved = None, {}, False, None
        self.profile = profile or StepProfile(None, "")

    def run(self, state, start: int, end: int) -> tuple:
        """Train steps `start + 1 .. end`; returns (state, the step it ended at). A run complete
        before it starts trains nothing and repeats its held-out result, from the restored state."""
        facts, throughput, memory = self.facts, Throughput(start), None
        self.saved = self.saved or start or None  # the newest checkpoint: the one resumed from, if any
        if start == end and self.eval_step is not None:
            self.eval_metrics = self.evaluate(state, start)
        for s in range(start + 1, end + 1):
            with self.profile.step(s):
                for micro in self.step.micro_batches(self.next_batch(s, state)):
                    memory = self.memory(state, micro) if s == start + 1 and memory is None else memory
                    state, metrics = self.step(state, micro)
            self.profile.done(s, metrics)
            self.writer.advance()
            record = {"step": s}
            if s == start + 1:  # once compiled: the model FLOPs per optimizer step, all devices
                flops, said = self.model_flops(micro)
                record["compile_s"] = throughput.first_step(metrics)
                self.writer.log(f"step {s} compiled and ran in {record['compile_s']:.1f} s (left out of samples/s)")
                record |= memory | said
            if facts.logs_at(s, end):
                m = jax.device_get(metrics)
                check_finite(s, m, self.config.train.max_nonfinite)
                record |= train_record(m, state, lr=self.spec.learning_rate(s - 1),
                                        samples=self.config.data.batch_size, steps_per_s=throughput(s),
                                        flops_per_step=flops and flops.per_step, peak=self.peak)
                self.final_loss = record["loss"]

            # Checkpoint before evaluating: all processes stop at the same step, and the last checkpoint
            # of a run is durable (awaited) before anything else can fail or say it exists.
            stop = s % self.check_every == 0 and any_process(self.signals.requested is not None)
            if facts.checkpoints_at(s, end) or stop:
                self.save(s, state, wait=stop or s == end)
            with self.saved_on_failure(s, state):
                self.writer.write(record)  # before evaluating: an evaluation that fails cannot lose it
                if self.eval_step is not None and not stop and facts.evaluates_at(s, end):
                    self.eval_metrics = self.evaluate(state, s)
                    self.writer.write({"step": s} | {f"eval_{k}": v for k, v in self.eval_metrics.items()})
            if stop:
                self.signals.checkpointed = True  # save(wait=True) above: it is on disk
                self.writer.log(stopping_line(s, self.signals.requested))
                self.preempted = True
                return state, s
        return state, end

    def model_flops(self, micro):
        """The step's model FLOPs (`step_model_flops`), said once off a CPU, and their record."""
        flops = step_model_flops(self.task, self.step, micro, self.config.data.batch_size)
        if not self.on_cpu:
            self.writer.log(flops_line(flops, self.peak_each, self.kind, self.dtype))
        return flops, {} if flops is None else {"model_flops_per_step": flops.per_step, "flops_source": flops.source}

    def memory(self, state, micro) -> dict:
        """Bytes per device of the state and of the compiled step's peak (`jdp.memory_report`), said at
        the start and written with the first step's record. The step compiled here is the one the
        first call runs (jax reuses the compilation)."""
        report = memory_report(self.step, state, micro)
        whole = f"; {report.whole_text()}" if report.whole else ""
        self.writer.log(f"memory per device ({report.layout}): state {report.state / 1e6:,.1f} MB, compiled "
                        f"step peak {(report.allocated or 0) / 1e6:,.1f} MB{whole}")
        return {"memory_state_bytes": report.state, "memory_peak_bytes": report.allocated}

    def evaluate(self, state, s: int) -> dict:
        """Metrics of `state` (after step `s`) over the whole held-out set; EvaluationOutOfMemoryError
        if the devices (or the host) run out of memory."""
        size = self.config.data.eval_batch_size
        try:
            metrics = evaluate(self.eval_step, *step_params(self.step, state), self.task.test, size, self.step.mesh)
            return language_model_units(metrics, self.task.bytes_per_token) if self.task.per_token else metrics
        except (MemoryError, RuntimeError) as e:  # XLA's out-of-memory is a JaxRuntimeError, a RuntimeError
            if not isinstance(e, MemoryError) and "RESOURCE_EXHAUSTED" not in str(e):
                raise
            raise evaluation_out_of_memory(s, e, size) from e

    def save(self, s: int, state, *, wait: bool) -> None:
        """Checkpoint step `s`; with `wait`, return only once it is complete on disk."""
        self.checkpoints.save(s, self.step, state, self.batches.get_state(), self.run_info)
        self.saved = s
        if wait:
            self.checkpoints.wait()

    def next_batch(self, s: int, state) -> dict:
        """Step `s`'s batch. If it cannot be read (a ValueError or OSError of the source: found only now),
        step `s - 1` is checkpointed first (one process; `saved_on_failure`) and DataStoppedError says so."""
        try:
            return next(self.batches)
        except (ValueError, OSError) as e:
            failure = e
        trained = s - 1
        if trained and self.saved != trained and jax.process_count() == 1:
            self.save(trained, state, wait=True)
        raise unreadable_batch(s, failure, self.saved) from failure

    @contextlib.contextmanager
    def saved_on_failure(self, s: int, state):
        """If the block (evaluation, metrics write) fails, checkpoint step `s` first, then re-raise.

        One process only: in a multi-process run the others are not there to join the save.
        """
        try:
            yield
        except Exception:
            if self.saved != s and jax.process_count() == 1:
                self.save(s, state, wait=True)
                self.writer.log(f"step {s} was trained but what followed it failed (below); checkpoint {s} is "
                                f"saved, so the same command resumes from it.")
            raise


def _resume(checkpoints: Checkpointer, parts: _Parts, log, fallback_to_intact: bool) -> tuple:
    """(state, its step) from the newest complete checkpoint, with the data position restored;
    (parts.state, None) without one. Another run's checkpoint, or one past train.steps, is refused
    and left untouched."""
    facts, latest = parts.facts, checkpoints.latest_step()
    if latest is None:
        return parts.state, None
    try:
        run = facts.compared_with(checkpoints.run_info(latest)["run"]["identity"], checkpoints.directory)
    except ValueError as e:  # damaged or unreadable: restore() says so, or falls back to an intact one
        if isinstance(e, CheckpointMismatchError):
            raise
        run = facts.checkpoint_run()
    state, data_state, resumed_from = checkpoints.restore(parts.step, parts.state, run,
                                                          fallback_to_intact=fallback_to_intact, log=log)
    if resumed_from > facts.steps:
        raise ValueError(f"train.steps={facts.steps} is fewer than the {resumed_from} steps that checkpoint "
                         f"{resumed_from} in {checkpoints.directory!r} has already trained; use --steps "
                         f"{resumed_from} or more to continue that run, or another --workdir.")
    parts.batches.set_state(data_state)
    log(f"resumed from step {resumed_from} in {checkpoints.directory}")  # every process restores, and says so
    return state, resumed_from


def schedule_facts(config: Config, devices=None, *, stop_after: int | None = None,
                   fallback_to_intact: bool = False) -> dict:
    """What every process of a multi-process run must agree on before its first step
    (`jdp.run.distributed.agree`): `RunFacts.of(...).agreed`, whose docstring lists the fields."""
    return RunFacts.of(config, devices, stop_after=stop_after, fallback_to_intact=fallback_to_intact).agreed


def meant_for_accelerators(config: Config, devices) -> bool:
    """Whether `config` asks for accelerators (train.accelerator_only) and `devices` are CPUs."""
    return config.train.accelerator_only and devices[0].platform == "cpu"


def _checked_devices(config: Config, devices, workdir: str, allow_cpu: bool = False, log=print) -> list:
    """The devices to train on (the config's count of the given ones, default all), config and
    workdir checked against them before anything is written."""
    devices = list(devices or jax.devices())
    if config.parallel.devices:
        devices = devices[:config.parallel.devices]
    validate(config, len(devices))
    if meant_for_accelerators(config, devices):
        if not allow_cpu:
            raise ValueError("the config is meant for accelerators (train.accelerator_only=true) and the devices are "
                             "CPUs; pass allow_cpu=True to train on them anyway.")
        log(f"train.accelerator_only=true but the {len(devices)} device(s) are CPUs: training on them anyway, as "
            f"asked (allow_cpu).")
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise ValueError(f"--workdir {workdir!r} exists and is not a directory.")
    return devices


def _describe(task, config: Config, devices, start: int, end: int) -> str:
    """The run's first console line: what, how far, on what, and how the global batch splits."""
    p, n, batch = config.parallel, len(devices), config.data.batch_size
    if start == config.train.steps:
        return f"{task.description}: the run is complete ({start} of {config.train.steps} steps), nothing to train"
    each = batch // (p.accum_steps * n)
    plural = lambda k, what: f"{k} {what}{'' if k == 1 else 's'}"  # noqa: E731
    return (f"{task.description}: {start} -> {end} of {config.train.steps} steps on {n} {devices[0].platform} "
            f"device(s), global batch {batch} = {plural(p.accum_steps, 'accumulation step')} × {plural(n, 'device')} "
            f"× {plural(each, 'example')} per device, {p.backend}, reduction {p.reduction}")


def _tracker(wandb: bool, workdir: str, config: Config, facts: RunFacts, devices):
    """The W&B offline run of `jdp train --wandb` (process 0 only), or None."""
    if not wandb or jax.process_index():
        return None
    from jdp.run.trackers import WandbOffline

    return WandbOffline(workdir, name=os.path.basename(os.path.abspath(workdir)), config=config.to_dict(),
                        config_hash=facts.config_hash, devices=len(devices))


def step_params(step, state):
    """(params, model_state) as one replicated copy, for evaluation."""
    canonical = step.canonical(state)
    return canonical.params, canonical.model_state


