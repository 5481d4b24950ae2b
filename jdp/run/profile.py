"""A `jax.profiler` trace of a range of optimizer steps: `--profile-steps FIRST:LAST` (`train.profile_steps`).

The trace starts before step FIRST is launched and stops once step LAST has finished on the devices,
so it holds steps FIRST..LAST whole (inclusive, counted as the run counts them: the first step of a
fresh run is 1), each marked by a `jax.profiler.StepTraceAnnotation("train", step_num=s)`. It is
written under `workdir/profile/plugins/profile/<time>/`: `*.xplane.pb` for TensorBoard's profile
plugin (`tensorboard --logdir workdir/profile`) and `perfetto_trace.json.gz` for https://ui.perfetto.dev
(open the file there; nothing is uploaded).
"""
from __future__ import annotations

import contextlib
import os

PROFILE_DIR = "profile"


def parse_steps(text: str | None) -> tuple[int, int] | None:
    """`"FIRST:LAST"` as (FIRST, LAST), 1 <= FIRST <= LAST; None for None. ValueError naming `text` otherwise."""
    if text is None:
        return None
    first, sep, last = str(text).partition(":")
    if sep and first.strip().isdigit() and last.strip().isdigit() and 1 <= int(first) <= int(last):
        return int(first), int(last)
    raise ValueError(f"profile steps {text!r} must be FIRST:LAST, two step numbers with 1 <= FIRST <= LAST "
                     f"(e.g. 20:25).")


class StepProfile:
    """Traces steps `steps` = (FIRST, LAST) of a run into `workdir/profile` (None: does nothing)."""

    def __init__(self, steps: tuple[int, int] | None, workdir: str, log=print):
        self.steps, self.dir, self.log, self.tracing = steps, os.path.join(workdir, PROFILE_DIR), log, False

    def step(self, s: int):
        """A context for launching step `s`: starts the trace before FIRST, marks each traced step."""
        import jax

        if self.steps is None or not self.steps[0] <= s <= self.steps[1]:
            return contextlib.nullcontext()
        if not self.tracing:
            jax.profiler.start_trace(self.dir, create_perfetto_trace=True)
            self.tracing = True
        return jax.profiler.StepTraceAnnotation("train", step_num=s)

    def done(self, s: int, outputs) -> None:
        """After step `s` was launched: at LAST, wait for its `outputs` and write the trace."""
        if self.tracing and s == self.steps[1]:
            import jax

            jax.block_until_ready(outputs)
            self.stop()
            self.log(f"profile of steps {self.steps[0]}..{s} written to {self.dir} (tensorboard --logdir "
                     f"{self.dir}, or open its perfetto_trace.json.gz in ui.perfetto.dev)")

    def stop(self) -> None:
        """Write the trace if one is running (a run that stops inside the range keeps what it traced)."""
        if self.tracing:
            import jax

            self.tracing = False
            jax.profiler.stop_trace()


__all__ = ["PROFILE_DIR", "StepProfile", "parse_steps"]
