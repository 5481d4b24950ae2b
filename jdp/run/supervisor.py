"""The supervisor of a multi-process `jdp train`: the training process runs in a child, and an
abnormal end (jax's distributed runtime aborting it from C++) becomes one sentence.

When a peer dies or stalls, or the coordinator refuses a process, jax's runtime (or gloo) aborts
the process from C++, where no Python handler runs, and prints a fatal log line and a C++ stack
dump. The supervisor relays the child's stderr to its own until that fatal line; from there on the
lines go only to `WORKDIR/jdp-process-<id>-<pid>.log`, and the console gets one sentence naming what
happened (the process that stopped sending heartbeats, a --process-id given twice, processes that
never joined) with advice that works, and exit code 1.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading

from jdp.run.exits import INTERRUPTED

SUPERVISED = "JDP_SUPERVISED"  # set in the child's environment: it trains instead of supervising
# jax's coordination service, when a peer's heartbeats stop (killed, stalled or cut off), lists
# the task ids it gave up on on the line after this text.
_NO_HEARTBEAT = "stopped sending heartbeats):"
# The start of an abort from C++: absl's fatal log line (F1201 21:46:15.083396 ...) or its stack dump.
_FATAL = re.compile(r"^(F\d{4} \d\d:\d\d:\d\d\.\d+ |\*\*\* Check failure stack trace|Fatal Python error: Abort)")
# The coordinator's answer to a process whose --process-id another process registered after it.
_DUPLICATE = "ALREADY_EXISTS: Aborted connect attempt as there is a request from a newer incarnation"
_NOT_ALL_JOINED = re.compile(r"DEADLINE_EXCEEDED[^\n]*\n+RPC: /xla\.coordination\.CoordinationService/RegisterTask")


class _Relay:
    """Copies the child's stderr to ours line by line, until a fatal C++ abort begins; keeps every
    line (the last 200 in `tail`, those not shown in `hidden`)."""

    def __init__(self, stream):
        self.tail, self.hidden = [], []
        self.thread = threading.Thread(target=self._run, args=(stream,), daemon=True)
        self.thread.start()

    def _run(self, stream) -> None:
        for line in iter(stream.readline, ""):
            if self.hidden or _FATAL.match(line):
                self.hidden.append(line)
            else:
                sys.stderr.write(line)
                sys.stderr.flush()
            self.tail.append(line)
            del self.tail[:-200]


def unresponsive_peers(stderr_tail: str) -> list[int]:
    """The process ids jax's coordination service reported as no longer sending heartbeats."""
    at = stderr_tail.find(_NO_HEARTBEAT)
    if at < 0:
        return []
    following = stderr_tail[at + len(_NO_HEARTBEAT):].strip().splitlines()
    return sorted({int(p) for p in following[0].replace(",", " ").split() if p.isdigit()}) if following else []


def abnormal_end(process_id, code: int, stderr_tail: str, heartbeat_s: int, *, num_processes: int | None = None,
                 init_timeout: int | None = None) -> str:
    """The one sentence for a training process that ended abnormally (`code`: its return code)."""
    how, me = signal_name(code), "this process" if process_id is None else f"process {process_id}"
    ids = f"0 to {num_processes - 1}" if num_processes else "0 to N-1"
    if _DUPLICATE in stderr_tail:
        return (f"{me} was refused by the coordinator ({how}): another process joined with the same --process-id "
                f"{process_id}; every process of a job needs its own id: stop every process of this job and start "
                f"each --process-id from {ids} exactly once.")
    if _NOT_ALL_JOINED.search(stderr_tail):
        return (f"{me} stopped ({how}) because not every process joined within --init-timeout {init_timeout} s; "
                f"stop every process of this job and start each --process-id from {ids} exactly once (one may "
                f"have been started twice or not at all), all with the same --coordinator.")
    peers = [p for p in unresponsive_peers(stderr_tail) if p != process_id]
    if peers:
        which = ", ".join(map(str, peers))
        return (f"{me} stopped ({how}) because process {which} stopped responding (it may be "
                f"stalled rather than dead): no heartbeat reached the coordinator for --heartbeat-timeout "
                f"{heartbeat_s} s (raise it for processes that may pause); the checkpoints are intact, so restart "
                f"every process with the same command to resume.")
    return (f"{me} stopped abnormally ({how}): a peer process died, lost its connection, or the "
            f"distributed runtime failed; the checkpoints are intact, so restart every process with the same "
            f"command to resume.")


def error_line(why: str, log: str | None) -> str:
    """The console line for an abnormal end: `why` (`abnormal_end`) and the runtime's log kept, if any."""
    return f"jdp: error: {why[:-1]}; the runtime's log is in {log!r}." if log else f"jdp: error: {why}"


def signal_name(code: int) -> str:
    return signal.Signals(-code).name if code < 0 else f"exit code {code}"


def _keep_log(workdir: str, process_id, lines: list[str]) -> str | None:
    """Write the runtime's hidden lines to `workdir/jdp-process-<id>-<pid>.log` (the pid: two processes
    given one id keep one log each; never through a symlink); the path, or None where it cannot be written."""
    path = os.path.join(workdir, f"jdp-process-{process_id if process_id is not None else 0}-{os.getpid()}.log")
    try:
        os.makedirs(workdir, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "w") as f:
            f.writelines(lines)
    except OSError:
        return None
    return path


def supervise(argv: list[str], process_id, heartbeat_s: int = 10, *, workdir: str = ".",
              num_processes: int | None = None, init_timeout: int | None = None) -> int:
    """Run this multi-process invocation in a child and explain an abnormal end in one sentence.

    The child's C++ abort (fatal log line and stack dump) goes to `workdir/jdp-process-<id>-<pid>.log`,
    not to the console; the sentence names the process that stopped sending heartbeats, a
    --process-id given twice, or processes that never joined, when jax's log says so; exit code 1.
    SIGTERM/SIGINT are forwarded, so preemption still reaches the training process.
    """
    def die_with_parent():  # Linux: a killed supervisor must not leave its training process behind
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG

    child = subprocess.Popen([sys.executable, "-m", "jdp.run.entry", *argv], env={**os.environ, SUPERVISED: "1"},
                             stderr=subprocess.PIPE, text=True, errors="replace",
                             preexec_fn=die_with_parent if sys.platform == "linux" else None)
    relay = _Relay(child.stderr)
    forward = lambda signum, frame: child.send_signal(signum)  # noqa: E731
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    code = child.wait()
    relay.thread.join(timeout=5)
    if code < 0 or code > 2 and code != INTERRUPTED:  # 130: Ctrl-C, reported by the training process
        why = abnormal_end(process_id, code, "".join(relay.tail), heartbeat_s, num_processes=num_processes,
                           init_timeout=init_timeout)
        kept = _keep_log(workdir, process_id, relay.hidden) if relay.hidden else None
        print(error_line(why, kept), file=sys.stderr)
        return 1
    return code


__all__ = ["SUPERVISED", "abnormal_end", "error_line", "signal_name", "supervise", "unresponsive_peers"]
