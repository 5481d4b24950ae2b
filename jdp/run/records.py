"""What a log step records: the training metrics and the throughput with compilation left out; and
the sentences of a run that stops early (too many non-finite updates, an evaluation out of memory,
a batch that cannot be read, a stop signal), built here so that the docs' quotes of them are
checked against the same functions (tests/test_docs.py)."""
from __future__ import annotations

import math
import time

import jax


class NonFiniteError(RuntimeError):
    """Training stopped: too many consecutive updates had non-finite gradients."""


class DataStoppedError(RuntimeError):
    """Training stopped: a batch could not be read (a data file changed under the run, a token id out of
    range found late, an I/O error); the steps trained before it are checkpointed (one process)."""


class EvaluationOutOfMemoryError(RuntimeError):
    """An evaluation ran out of memory; the step it followed is recorded (and checkpointed, one process)."""


class Throughput:
    """Optimizer steps per second since the previous log step, compilation left out: the clock
    restarts once this invocation's first step has finished (`first_step`)."""

    def __init__(self, step: int):
        self.step, self.time = step, time.perf_counter()

    def first_step(self, outputs) -> float:
        """Seconds from the start to the end of the first step (its compilation included), waiting
        for its `outputs`; the rate then counts from here."""
        jax.block_until_ready(outputs)
        now = time.perf_counter()
        seconds, self.step, self.time = now - self.time, self.step + 1, now
        return seconds

    def __call__(self, step: int) -> float | None:
        """Steps per second since the last call (or the first step); None when no step has run since."""
        now = time.perf_counter()
        rate = (step - self.step) / (now - self.time) if step > self.step else None
        self.step, self.time = step, now
        return rate


def check_finite(s: int, m: dict, max_nonfinite: int) -> None:
    """Raise NonFiniteError once `max_nonfinite` updates in a row were skipped (0: never)."""
    if max_nonfinite and int(m["skip_streak"]) >= max_nonfinite:
        raise NonFiniteError(f"training stopped at step {s}: the last {int(m['skip_streak'])} updates had "
                             f"non-finite gradients (train.max_nonfinite={max_nonfinite}); the newest checkpoint "
                             f"is from before them.")


def evaluation_out_of_memory(s: int, error: BaseException, eval_batch_size: int) -> EvaluationOutOfMemoryError:
    """The error for the evaluation after step `s`, which ran out of memory with `error` (XLA's
    RESOURCE_EXHAUSTED, or the host's MemoryError)."""
    reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
    return EvaluationOutOfMemoryError(
        f"the evaluation after step {s} ran out of memory ({reason}); lower data.eval_batch_size (now "
        f"{eval_batch_size}) and rerun the same command, which resumes from the newest checkpoint")


def unreadable_batch(s: int, failure: Exception, saved: int | None) -> DataStoppedError:
    """The error for step `s`, whose batch could not be read (`failure`: the source's ValueError or
    OSError); `saved`: the step of the newest checkpoint, None if there is none."""
    trained = s - 1
    kept = (f"the {trained} steps before it are saved in checkpoint {trained}" if saved == trained else
            f"the newest checkpoint is step {saved}" if saved else "no checkpoint was saved")
    reason = str(failure).rstrip(".") if isinstance(failure, ValueError) else f"{type(failure).__name__}: {failure}"
    return DataStoppedError(f"training stopped before step {s}, whose batch could not be read: {reason}; {kept}")


def stopping_line(s, signal: str | None) -> str:
    """The line a run stopped by `signal` logs once the checkpoint of step `s` is on disk."""
    return (f"stopping at step {s} on {signal or 'a peer process signal'}; checkpoint saved, rerun the same "
            f"command to resume.")


def train_record(m: dict, state, *, lr: float, samples: int, steps_per_s: float, flops_per_step: float | None,
                  peak: float) -> dict:
    """A log step's training metrics from the step's host metrics `m`: loss, gradient norm, learning
    rate, throughput, the aux metrics as train_*, the global weight of a weighted loss (the gpt's
    tokens per step), FLOP/s and MFU where known (`peak`: all devices'
    peak FLOP/s, 0 if unknown), and the count of skipped updates once any update was skipped."""
    record = {"loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]), "lr": lr,
              **({} if steps_per_s is None else {"samples_per_s": steps_per_s * samples}),  # None: the first step alone
              **{f"train_{k}": float(v) for k, v in m["aux"].items()}}
    if "weight" in m:  # a weighted loss (the gpt: per token): the step's global weight, its real tokens
        record["weight"] = float(m["weight"])
    if flops_per_step and steps_per_s is not None:
        record["flops_per_s"] = steps_per_s * flops_per_step
        if peak:
            record["mfu"] = record["flops_per_s"] / peak
    if m["skipped"]:
        record["skipped_total"] = int(jax.device_get(state.skipped).reshape(-1)[0])
    return record


def language_model_units(metrics: dict, bytes_per_token: float | None) -> dict:
    """A language model's held-out `metrics` with its loss in the units language models are read in.

    `loss` is the mean over every held-out token of -ln p(token) (nats per token, exact over the
    whole set: `jdp.core.evaluate`); added: `perplexity` = exp(loss), and where the UTF-8 bytes of
    text per token are known, `bits_per_byte` = loss / ln 2 / bytes_per_token: bits per byte of
    text, the same unit whatever the tokenizer (bytes, characters, BPE), so such runs compare.
    """
    loss = metrics["loss"]
    units = {"perplexity": math.exp(loss) if loss < 700 else math.inf}  # exp(700) ~ 1e304: float's edge
    if bytes_per_token:
        units["bits_per_byte"] = loss / math.log(2) / bytes_per_token
    return {**metrics, **units}
