"""How the `jdp` command ends on Ctrl-C and on a closed pipe: one line and exit code 130, or
silence and 141, never a traceback.

It imports only os, signal and sys: the entry point (`jdp.run.entry`) imports it to install the
SIGINT handler before anything heavier is imported.
"""
from __future__ import annotations

import os
import signal
import sys

INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a command stopped with Ctrl-C
CLOSED_PIPE = 141  # 128 + SIGPIPE, as a command killed by writing to a closed pipe


def run_quietly(command, *args) -> int:
    """`command(*args)` (an exit code) with Ctrl-C and a closed pipe turned into their exit codes:
    a SIGINT outside a run's training loop prints one line and exits 130 at once (`_interrupted`);
    a KeyboardInterrupt (a caller's own handler) returns 130 after that line; a BrokenPipeError
    on stdout returns 141, silently. The SIGINT handler is restored on the way out."""
    previous = quiet_interrupts()
    try:
        return command(*args)
    except KeyboardInterrupt:  # a Ctrl-C in a caller's own handler (main() called in-process)
        print(_INTERRUPTED_LINE, file=sys.stderr)
        return INTERRUPTED
    except BrokenPipeError:
        _quiet_closed_stdout()
        return CLOSED_PIPE
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def quiet_interrupts():
    """Make a SIGINT print one line and exit 130 at once (`_interrupted`); the handler it replaces,
    or None off the main thread, where signals are left alone."""
    try:
        return signal.signal(signal.SIGINT, _interrupted)
    except ValueError:  # not the main thread
        return None


_INTERRUPTED_LINE = "jdp: interrupted (Ctrl-C); a run's checkpoints already saved are intact."


def _interrupted(signum, frame) -> None:
    """Ctrl-C outside a run's training loop (which stops at a step, with a checkpoint: jdp.run.train's
    StopSignals): one line and exit 130 at once. A KeyboardInterrupt would not do: raised in whatever
    Python code runs next, which after a long call into XLA is often jax's garbage-collection
    callback, where Python prints it as "Exception ignored" and carries on. Nothing is being saved
    then: every checkpoint and metrics write happens inside the loop's handler."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or broken stream (or None): the line goes out below anyway
            pass
    try:
        os.write(2, (_INTERRUPTED_LINE + "\n").encode())
    except OSError:
        pass
    os._exit(INTERRUPTED)


def _quiet_closed_stdout() -> None:
    """Point stdout at /dev/null: the interpreter's last flush would fail on the closed pipe again
    and print "Exception ignored ... BrokenPipeError"."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


__all__ = ["CLOSED_PIPE", "INTERRUPTED", "quiet_interrupts", "run_quietly"]
