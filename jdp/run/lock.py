"""One run per workdir: a lock file held with flock(2) for as long as the run lives.

Two runs on one workdir (two terminals, a re-submitted job) would interleave the checkpoints and
metrics of two configurations. The lock is `workdir/.jdp-lock`, locked with `fcntl.flock` on an
open descriptor: the kernel releases it when the process ends, however it ends (kill -9
included), so a lock file left behind by a killed run is stale by construction and the next run
takes it over. The file names its holder (pid, host, start time) so that a refused run can say
who holds the workdir. The processes of one multi-process job share their workdir: process 0
locks it for all of them and tells the others the outcome (`locked_workdir`).
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time

from jdp.run.workfiles import open_nofollow

LOCK_NAME = ".jdp-lock"
_READ_TRIES = 20  # a holder writes its name right after locking: give it up to ~1 s to appear


class WorkdirLockedError(ValueError):
    """Another live run holds the workdir."""


def _holder_text(raw: bytes) -> str | None:
    """'pid P on host H, started T' from a lock file's contents; None if empty or not jdp's."""
    try:
        h = json.loads(raw.decode())
        return f"pid {int(h['pid'])} on {h['host']!r}, started {h['started']}"
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def _read(fd: int) -> bytes:
    return os.pread(fd, 4096, 0)


class WorkdirLock:
    """An exclusive, non-blocking lock on `workdir` (created if missing); `release()` removes the file."""

    def __init__(self, workdir: str):
        self.workdir = workdir
        self.path = os.path.join(workdir, LOCK_NAME)
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock now."""
        return self._fd is not None

    def acquire(self) -> str | None:
        """Take the lock, or raise WorkdirLockedError naming its live holder.

        Returns the holder named by a stale lock file that was taken over (None if there was none).
        Raises ValueError when the workdir cannot be created or the lock file cannot be written.
        """
        self._make_workdir()
        for _ in range(100):  # only a release racing this acquire makes it go round again
            try:  # a symlink left at the lock's path is refused, never followed into another file
                fd = open_nofollow(self.path, os.O_RDWR | os.O_CREAT, "the lock file")
            except OSError as e:
                raise self._unwritable(e) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = self._live_holder(fd)
                os.close(fd)
                raise WorkdirLockedError(
                    f"--workdir {self.workdir!r} is in use by another run ({holder}); wait for it to end or "
                    f"stop it, or use another --workdir.") from None
            except OSError as e:  # a file system without flock
                os.close(fd)
                raise ValueError(f"--workdir {self.workdir!r} cannot be locked against a second run "
                                 f"({e.strerror}); use a --workdir on a local file system.") from None
            # A releasing holder unlinks the file before unlocking it: a lock won on that old file
            # guards nothing, so try again on the file now at the path.
            if self._same_file(fd):
                return self._claim(fd)
            os.close(fd)
        raise WorkdirLockedError(f"--workdir {self.workdir!r} is being locked and released by other runs over "
                                 f"and over; use another --workdir.")

    def _make_workdir(self) -> None:
        if os.path.exists(self.workdir) and not os.path.isdir(self.workdir):
            raise ValueError(f"--workdir {self.workdir!r} exists and is not a directory.")
        try:
            os.makedirs(self.workdir, exist_ok=True)
        except OSError as e:
            raise self._unwritable(e) from None

    def _unwritable(self, e: OSError) -> ValueError:
        reason = f"{e.strerror}: {e.filename!r}" if e.strerror and e.filename else str(e)
        return ValueError(f"--workdir {self.workdir!r} cannot be written ({reason}); use a --workdir you can "
                          f"write to.")

    def _same_file(self, fd: int) -> bool:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return False
        mine = os.fstat(fd)
        return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)

    def _live_holder(self, fd: int) -> str:
        """The holder of a lock that is held right now (it may have locked a moment ago, not yet named)."""
        for _ in range(_READ_TRIES):
            holder = _holder_text(_read(fd))
            if holder:
                return holder
            time.sleep(0.05)
        return "its lock file does not name it"

    def _claim(self, fd: int) -> str | None:
        """Name this process as the holder of the lock won on `fd`; the stale holder's name, if any."""
        previous = _holder_text(_read(fd))
        me = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                         "started": time.strftime("%Y-%m-%d %H:%M:%S %z")}).encode()
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, me, 0)
        except OSError as e:  # a full disk: the lock holds without a name, but say why the run stops
            os.close(fd)
            raise self._unwritable(e) from None
        self._fd = fd
        return previous

    def release(self) -> None:
        """Remove the lock file and unlock (in that order, see `acquire`); a no-op if not held."""
        if self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        os.close(self._fd)  # the kernel drops the flock with the last descriptor
        self._fd = None


def _from_process_0(message: str | None) -> str | None:
    """Process 0's `message` (None: none), on every process of a multi-process run."""
    import numpy as np
    from jax.experimental import multihost_utils

    buffer = np.zeros(2048, np.uint8)
    if message is not None:
        data = b"!" + message.encode()[:2046]  # a leading byte, so an empty message still counts
        buffer[:len(data)] = np.frombuffer(data, np.uint8)
    shared = bytes(np.asarray(multihost_utils.broadcast_one_to_all(buffer))).rstrip(b"\0")
    return shared[1:].decode(errors="replace") if shared else None


@contextlib.contextmanager
def locked_workdir(workdir: str, log=print):
    """Hold `workdir` for this run (all processes of a multi-process run) until the block ends.

    Process 0 takes the lock and shares the outcome, so every process of a job refused because
    another run holds the workdir raises the same WorkdirLockedError (a ValueError). A stale lock,
    left by a run that was killed, is taken over and `log` says whose it was.
    """
    import jax

    lock, error, previous = WorkdirLock(workdir), None, None
    try:
        if jax.process_index() == 0:
            try:
                previous = lock.acquire()
            except ValueError as e:
                error = e
        if jax.process_count() > 1:
            shared = _from_process_0(None if error is None else str(error))
            if shared is not None and error is None:
                error = ValueError(shared)  # the sentence process 0 raised
        if error is not None:
            raise error
        if previous:
            log(f"took over the lock of an earlier run on this workdir ({previous}), which ended without "
                f"releasing it.")
        yield lock
    finally:
        lock.release()


__all__ = ["LOCK_NAME", "WorkdirLock", "WorkdirLockedError", "locked_workdir"]
