"""A run's numbers: where its records go (metrics.jsonl, TensorBoard, console), FLOPs and MFU, plots.

`MetricsWriter` is the one place a training run writes to: off the primary process it writes
nothing, so the loop needs no `if primary` branches (as flax's `create_default_writer(just_logging=...)`).
"""
from __future__ import annotations

import json
import os
import tempfile

import numpy as np

from jdp.run.workfiles import SymlinkRefusedError, open_nofollow, refuse_symlink

# Peak dense (no sparsity) tensor-core FLOP/s per device and compute dtype, from the vendors' data
# sheets: the denominator of MFU. Keys are matched in order as substrings of jax's `device.device_kind`
# (e.g. "NVIDIA H100 80GB HBM3" for the SXM part), so the more specific names come first. float32 is
# TF32's peak: jax's default matmul precision runs float32 matmuls as TF32 on these GPUs. A device or
# dtype not listed (CPUs among them) gets no MFU, never a guessed one.
PEAK_FLOPS = {
    "bfloat16": {"H100 PCIe": 756e12, "H100 NVL": 835e12, "H100": 989e12,  # SXM
                 "H200 NVL": 835e12, "H200": 989e12,  # SXM
                 "B200": 2250e12, "A100": 312e12,  # SXM and PCIe
                 "L40S": 362e12, "TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v6 lite": 918e12},
    "float32": {"H100 PCIe": 378e12, "H100 NVL": 417.5e12, "H100": 494.5e12, "H200 NVL": 417.5e12,
                "H200": 494.5e12, "A100": 156e12, "L40S": 183e12},
}


def peak_flops(device_kind: str, dtype: str = "bfloat16") -> float | None:
    """Peak dense FLOP/s of one device of `device_kind` (e.g. "NVIDIA H200") computing in `dtype`
    ("bfloat16" or "float32"); None if not listed."""
    table = PEAK_FLOPS.get(dtype, {})
    return next((v for k, v in table.items() if k in (device_kind or "")), None)


def step_model_flops(task, step, micro, samples: int):
    """Model FLOPs of one optimizer step over the global batch of `samples` examples
    (`jdp.inspect.flops.ModelFlops`): the task's own count per example where it has one (jdp's GPT:
    6N+12LHQT per token), else 3 × the forward FLOPs of `task.loss_fn` traced on one device's share of
    the call's micro-batch `micro`, × devices × accumulation steps. None if the loss cannot be traced.
    Never from the compiled program (`jdp.inspect.flops` says why)."""
    import jax

    from jdp.inspect.flops import ModelFlops, program_model_flops

    if getattr(task, "flops_per_example", None):
        return ModelFlops(task.flops_per_example * samples, task.flops_source)
    n = step.num_devices
    spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct((x.shape[0] // n, *x.shape[1:]), x.dtype), micro)
    axes = list(getattr(step.mesh, "shape", {}).items())
    try:
        return program_model_flops(task.loss_fn, task.params, task.model_state, spec, jax.random.key(0),
                                   examples_scale=n * step.accum_steps, axis_env=axes)
    except Exception:  # a loss jax cannot trace on its own (outside the step): no MFU rather than a wrong one
        return None


def flops_line(flops, peak: float | None, device_kind: str, dtype: str) -> str:
    """The line a run on an accelerator says once: its model FLOPs per step and their count, and the
    peak MFU divides by, or why there is no MFU."""
    count = ("model FLOPs: none (the loss could not be traced on its own)" if flops is None else
             f"model FLOPs per step: {flops.per_step / 1e12:,.3f} TFLOP ({flops.source})")
    where = (f"MFU against {peak / 1e12:,.1f} TFLOP/s {dtype} per device ({device_kind})" if peak else
             f"no MFU: jdp has no peak FLOP/s for device kind {device_kind!r} in {dtype}")
    return f"{count}; {where}"


class TensorBoard:
    """Scalars to TensorBoard event files under `workdir/tensorboard` (needs tensorboardX)."""

    def __init__(self, workdir: str):
        from jdp.extras import require

        writer = require("tensorboardX", "tensorboard", "--tensorboard").SummaryWriter
        refuse_symlink(os.path.join(workdir, "tensorboard"), "the TensorBoard directory")
        self._writer = writer(os.path.join(workdir, "tensorboard"))

    def write(self, record: dict) -> None:
        """Every scalar of `record` except its "step", at that step."""
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)):  # not a record's words (flops_source)
                self._writer.add_scalar(key, value, record["step"])
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class MetricsWriter:
    """A run's records to `workdir/metrics.jsonl` (and TensorBoard), and its progress to the console.

    The console shows one line per record (training and evaluation) and, with `progress=True`, a
    progress bar below them (rich's live display: lines print above it) that shows the latest loss
    and throughput and is removed when the run ends. `tracker`: another sink with `write(record)` and
    `close()` (`jdp.run.trackers.WandbOffline`). With
    `active=False` (any process but the primary one) it opens nothing and writes nothing. Use it as
    a context manager: it shows the bar inside and closes every file on the way out.
    """

    def __init__(self, workdir: str, *, total: int, start: int, log=print, progress: bool = True,
                 tensorboard: bool = False, active: bool = True, tracker=None):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self._log, self._progress = (log if active else None), progress
        # A bar only on a terminal: into a pipe or a file rich would end with the bar's last frame (or an
        # empty line). Transient: a finished run leaves its lines, not a bar.
        shown = progress and active and Console().is_terminal
        self._bar = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                             TextColumn("{task.description}"), TimeRemainingColumn(), disable=not shown, transient=True)
        self._task = self._bar.add_task("", total=total, completed=start)
        # TensorBoard first: a missing tensorboardX stops the run before metrics.jsonl is opened.
        self._board = TensorBoard(workdir) if tensorboard and active else None
        self._file, self._tracker = None, tracker
        if active:
            path = os.path.join(workdir, "metrics.jsonl")
            try:
                if (repaired := repair_metrics(path, start)) is not None:
                    self.log(f"{path}: {repaired}")
                self._file = os.fdopen(open_nofollow(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, "the metrics file"),
                                       "a")
            except SymlinkRefusedError:
                self.close()
                raise
            except OSError as e:
                self.close()
                raise ValueError(_unwritable(path, e)) from None

    def log(self, message: str) -> None:
        """A line on the console (printed above the progress bar while it is shown)."""
        if self._log is not None:
            self._log(message)

    def advance(self) -> None:
        """One more optimizer step on the progress bar."""
        self._bar.advance(self._task)

    def write(self, record: dict) -> None:
        """One record (`{"step": s, ...}`) to every sink; a record with nothing but its step is dropped."""
        if self._file is None or len(record) < 2:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()  # a crash loses at most the step in flight
        if self._board is not None:
            self._board.write(record)
        if self._tracker is not None:
            self._tracker.write(record)
        s = record["step"]
        if "loss" in record:
            # No rate for a log step whose interval holds only the first (compiling) step.
            rate = f"  {record['samples_per_s']:,.0f} samples/s" if "samples_per_s" in record else ""
            self._bar.update(self._task, description=f"loss {record['loss']:.4f}{rate}")
            self.log(f"step {s:6d}  loss {record['loss']:.4f}  grad_norm {record['grad_norm']:.3f}  "
                     f"lr {record['lr']:.2e}{rate}")
        evals = {k.removeprefix("eval_"): v for k, v in record.items() if k.startswith("eval_")}
        if evals:
            self.log(f"step {s:6d}  eval " + eval_text(evals))

    def close(self) -> None:
        """Stop the progress bar and close the files."""
        self._bar.stop()
        if self._board is not None:
            self._board.close()
        if self._tracker is not None:
            self._tracker.close()
            self._tracker = None
        if self._file is not None:
            self._file.close()

    def __enter__(self):
        self._bar.start()
        return self

    def __exit__(self, *exc):
        self.close()


def eval_text(evals: dict) -> str:
    """Held-out metrics as the console shows them: `name value` pairs; a language model's loss (its
    metrics hold a perplexity) as `loss/token`, the mean per token."""
    per_token = "perplexity" in evals
    return "  ".join(f"{'loss/token' if k == 'loss' and per_token else k} {v:.4f}" for k, v in evals.items())


def _unwritable(path: str, error: OSError) -> str:
    if os.path.isdir(path):
        return f"{path!r} is a directory, not a metrics file; move it away or use another --workdir."
    return f"{path!r} cannot be written ({error.strerror or error}); use a --workdir you can write to."


def repair_metrics(path: str, step: int) -> str | None:
    """Make `path` (a metrics.jsonl) hold each step once before a run continues from `step`.

    A killed run leaves the records of the steps after its last checkpoint, which the resumed run
    writes again, and may leave a last line cut mid-record, which the next record would be glued
    to. Drops both (records are in step order: the records past `step` are the last ones; lines
    that are not records are left alone), rewriting the file atomically (a temporary file, then
    os.replace). Returns what was dropped, or None if the file is missing or needed nothing.
    """
    if not os.path.lexists(path):
        return None
    refuse_symlink(path, "the metrics file")
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    torn = lines.pop() != b""  # the text after the last newline: a record cut mid-write
    keep = len(lines)
    while keep and _record_step(lines[keep - 1]) is not None and _record_step(lines[keep - 1]) > step:
        keep -= 1
    if not torn and keep == len(lines):
        return None
    fd, temporary = tempfile.mkstemp(prefix=".metrics.jsonl.", dir=os.path.dirname(path) or ".")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(b"".join(line + b"\n" for line in lines[:keep]))
            f.flush()
            os.fsync(f.fileno())
        os.chmod(temporary, os.stat(path).st_mode & 0o7777)  # mkstemp's file is private
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise
    dropped = [f"{len(lines) - keep} record(s) past step {step}"] if keep < len(lines) else []
    return ("dropped " + " and ".join(dropped + ["a last line cut mid-record"] * torn)
            + f", which the run writes again from step {step + 1}")


def _record_step(line: bytes) -> int | None:
    """The step of a metrics record line; None for anything else."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    step = record.get("step") if isinstance(record, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


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


def plot_metrics(workdir: str, path: str | None = None, name: str | None = None) -> str:
    """Save a PNG of the loss (train, eval) and accuracy curves of a run; returns its path.

    `name` titles the figure (default: the run directory's name)."""
    records = load_metrics(workdir)
    if path is None:  # the default lies inside the workdir: never written through a symlink
        path = os.path.join(workdir, "curves.png")
        refuse_symlink(path, "the plot")
    fig = curves_figure(records, name or os.path.basename(os.path.abspath(workdir)))
    try:
        fig.savefig(path, dpi=110)
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
    return path


# metrics.jsonl key -> (panel, legend label, marked); evaluation points are few: each gets a marker.
CURVES = {"loss": ("loss", "train (the logged step's batch)", False),
          "eval_loss": ("loss", "held-out", True),
          "train_accuracy": ("accuracy", "train (the logged step's batch)", False),
          "eval_accuracy": ("accuracy", "held-out", True)}


def curves_figure(records: list[dict], name: str | None = None):
    """The matplotlib Figure `plot_metrics` saves: loss and accuracy against the optimizer step, titled `name`.
    The loss axis says its unit: the mean per token for a language model, per example otherwise.

    Evaluation series, and any series of a single record, are drawn with markers: a line through
    one point is drawn as nothing (a run of one logged step, or the first eval of a long run).
    """
    from jdp.extras import require

    matplotlib = require("matplotlib", "plot", "jdp plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    panels = dict(zip(("loss", "accuracy"), axes))
    for key, (panel, label, marked) in CURVES.items():
        pts = [(r["step"], r[key]) for r in records if key in r]
        if pts:
            marked = marked or len(pts) == 1
            panels[panel].plot(*np.array(pts).T, marker="o" if marked else None, markersize=6,
                               linestyle="--" if marked else "-", label=label, gid=key, zorder=3 if marked else 2)
    # A language model's loss is a mean per token: its records hold a perplexity, or the step's tokens (weight).
    per = "token" if any("eval_perplexity" in r or "weight" in r for r in records) else "example"
    for ax, ylabel in zip(axes, (f"loss (mean per {per})", "accuracy (fraction correct)")):
        ax.set(xlabel="optimizer step", ylabel=ylabel)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend()
    fig.suptitle(f"{name}: loss and accuracy" if name else "loss and accuracy")
    fig.tight_layout()
    return fig
