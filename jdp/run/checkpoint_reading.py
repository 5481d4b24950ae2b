"""Reading the newest intact checkpoint of a run, beside a `jdp train` that may be rotating them.

`newest_intact(checkpoints, step_for, log)` takes the newest checkpoint that exists when it reads
it: one removed between the listing and the read (a running `jdp train` rotates its checkpoints
away as it saves new ones) is not damaged, so the directory is listed again and the newest one
there now is read, said in one line at most. A damaged checkpoint is said in one line and skipped
for the one before it. Orbax and tensorstore report a failed read in their own ways besides the
exception (absl log records; "Event loop is closed" errors raised in tensorstore's callbacks after
the read gave up, printed as unraisable tracebacks, hundreds of lines for some cuts):
`quiet_orbax` collects the first and drops the second while a checkpoint is read, so the line jdp
writes is the only one. Nothing on disk is changed.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
from typing import Any, Callable

from jdp.run.checkpoint_faults import DamagedCheckpointError


class _Collect(logging.Handler):
    """Keeps orbax's (absl's) log records of a read instead of printing them."""

    def __init__(self, found: list):
        super().__init__(logging.WARNING)
        self.found = found

    def emit(self, record: logging.LogRecord) -> None:
        self.found.append(record.getMessage())


def _event_loop_closed(unraisable) -> bool:
    """An error tensorstore's callback raised into the event loop orbax closed after a failed read."""
    return isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed"


@contextlib.contextmanager
def quiet_orbax(found: list):
    """While a checkpoint is read: orbax's WARNING-or-above log records go into `found` (their messages),
    not to the console, and the "Event loop is closed" errors of its abandoned callbacks are dropped
    (any other unraisable error still reaches the hook). Garbage is collected before leaving, so the
    callbacks of a failed read fire inside."""
    logger = logging.getLogger("absl")
    collect, hook = _Collect(found), sys.unraisablehook
    saved = logger.handlers, logger.propagate
    logger.handlers, logger.propagate = [collect], False
    sys.unraisablehook = lambda u: None if _event_loop_closed(u) else hook(u)
    try:
        yield
    finally:
        gc.collect()
        sys.unraisablehook = hook
        logger.handlers, logger.propagate = saved


def _summary(text: str, most: int = 200) -> str:
    """The first line of a logged message, at most `most` characters."""
    line = (text.strip().splitlines() or [""])[0]
    return line if len(line) <= most else line[:most - 1] + "…"


def _read(checkpoints, number: int, step_for: Callable[[dict], tuple], found: list) -> tuple:
    """(state, config) of checkpoint `number`, verified, read quietly (orbax's log records into `found`)."""
    with quiet_orbax(found):
        run = checkpoints.run_info(number)["run"]
        step, like = step_for(run.get("config"))
        restored, _ = checkpoints._restore_verified(step, like, run, number)
        return step.place(restored, like), run.get("config")


def newest_intact(checkpoints, step_for: Callable[[dict], tuple], log: Callable[[str], Any]) -> tuple:
    """`(state, config, step_number)` of the newest intact checkpoint of `checkpoints` (a
    `jdp.run.checkpoint.Checkpointer`) that exists when it is read; see the module's docstring.

    `step_for(config)` gives `(step, like)` for the run's saved config. `log` gets at most one line per
    checkpoint skipped (damaged), one line in all for checkpoints removed while being read, and one line
    if orbax complained of a checkpoint that then read back verified. ValueError if none is intact.
    """
    directory, tried, damaged, removed = checkpoints.directory, set(), [], []
    while True:
        found = []  # orbax's complaints while listing (a step's metadata file) and reading: said once, summarised
        with quiet_orbax(found):
            steps = [s for s in checkpoints.steps_now() if s not in tried]
        if not steps:
            break
        number = max(steps)
        tried.add(number)
        try:
            state, config = _read(checkpoints, number, step_for, found)
        except Exception as e:
            if not os.path.isdir(os.path.join(directory, str(number))):  # rotated away, not damaged
                if not removed:
                    log(f"checkpoint {number} in {directory!r} was removed while it was being read (a running jdp "
                        f"train rotates its checkpoints), so it is not damaged; reading the newest one there now")
                removed.append(number)
                continue
            if not isinstance(e, DamagedCheckpointError):
                raise
            log(f"{e.finding}; trying the one before it")
            damaged.append(number)
            continue
        if found:
            log(f"checkpoint {number} in {directory!r}: orbax reported {_summary(found[0])!r}; its arrays and run "
                f"metadata match their sha256, so it is read")
        return state, config, number
    if not tried:
        raise ValueError(f"no complete checkpoint in {directory!r}: train the run first (jdp train ... --workdir), or "
                         f"name another run's directory.")
    gone = f"; checkpoints {', '.join(map(str, removed))} were removed while being read" if removed else ""
    if not damaged:
        raise ValueError(f"no checkpoint is left in {directory!r}: checkpoints {', '.join(map(str, removed))} were "
                         f"removed while being read (a running jdp train rotates them); run jdp sample again.")
    raise ValueError(f"no intact checkpoint in {directory!r}: checkpoints {', '.join(map(str, damaged))} are damaged"
                     f"{gone}.")


__all__ = ["newest_intact", "quiet_orbax"]
