"""Files inside a workdir: never through a symlink jdp did not create, never deleting what it did not write.

jdp often runs as root on shared machines, in directories like `/tmp` where anyone can leave a
symlink. A run writes only below its workdir: every file it creates, appends to, renames or
deletes there is opened with `O_NOFOLLOW` or checked with `lstat` first, and a symlink in its way
is refused in one sentence (the workdir itself may be a symlink: the user named it). A checkpoint
directory is deleted (rotation) only once it is proven to be jdp's: a real directory holding
orbax's commit record and jdp's metadata with its checksums, each read without following a link.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import stat

# Checkpoints being deleted are first renamed to this prefix (atomic), so a kill mid-deletion
# leaves a name only jdp gives, which the next rotation finishes removing.
DELETING = ".jdp-deleting-"
_COMMIT = "_CHECKPOINT_METADATA"  # orbax writes it last into a checkpoint it has finalised


class SymlinkRefusedError(ValueError):
    """A path jdp would write through is a symlink it did not create."""


def refusal(path: str, what: str) -> SymlinkRefusedError:
    """The one-sentence refusal for `path` (`what` it is, e.g. "the lock file"), a symlink."""
    try:
        target = os.readlink(path)
    except OSError:
        target = "?"
    return SymlinkRefusedError(f"{what} {path!r} is a symlink (to {target!r}) that jdp did not create; jdp writes "
                               f"only inside its workdir and never through such a link: remove the link or use "
                               f"another --workdir.")


def refuse_symlink(path: str, what: str) -> None:
    """Raise SymlinkRefusedError if `path` is a symlink (a missing path is fine)."""
    if os.path.islink(path):
        raise refusal(path, what)


def refuse_symlinks_in(directory: str, what: str) -> None:
    """Raise SymlinkRefusedError naming the first symlink directly inside `directory` (jdp makes none there)."""
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for entry in sorted(os.scandir(directory), key=lambda e: e.name):
            if entry.is_symlink():
                raise refusal(entry.path, f"{what} entry")


def open_nofollow(path: str, flags: int, what: str, mode: int = 0o644) -> int:
    """`os.open(path, flags | O_NOFOLLOW | O_CLOEXEC, mode)`; a symlink at `path` is refused, not followed."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno == errno.ELOOP and os.path.islink(path):
            raise refusal(path, what) from None
        raise


def _read_below(dir_fd: int, names: list[str], limit: int = 1 << 24) -> bytes:
    """The bytes of the regular file `names` below `dir_fd`, no component followed if it is a link."""
    fds = []
    try:
        fd = dir_fd
        for name in names[:-1]:
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            fds.append(fd)
        fd = os.open(names[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
        fds.append(fd)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        return os.read(fd, limit)
    finally:
        for fd in reversed(fds):
            os.close(fd)


def is_jdp_checkpoint(path: str) -> bool:
    """Whether `path` is provably a checkpoint jdp wrote: a real directory (not a link) holding
    orbax's commit record (`_CHECKPOINT_METADATA`, with its commit time) and jdp's metadata
    (`meta/metadata`: the run and the checksums of a save), none of them reached through a link."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        commit = json.loads(_read_below(fd, [_COMMIT]))
        meta = json.loads(_read_below(fd, ["meta", "metadata"]))
    except (OSError, ValueError):
        return False
    finally:
        os.close(fd)
    return (isinstance(commit, dict) and commit.get("commit_timestamp_nsecs") is not None and isinstance(meta, dict)
            and isinstance(meta.get("checksums"), dict) and isinstance(meta.get("run"), dict))


def remove_checkpoint(directory: str, name: str) -> bool:
    """Delete checkpoint `directory/name` if it is provably jdp's (`is_jdp_checkpoint`); False if kept.

    It is renamed to a `DELETING` name first, so that an interrupted deletion never leaves a
    half-deleted checkpoint under a step's name; `shutil.rmtree` then removes it without following
    any link inside it.
    """
    path = os.path.join(directory, name)
    if not is_jdp_checkpoint(path):
        return False
    doomed = os.path.join(directory, DELETING + name)
    os.rename(path, doomed)
    _remove_doomed(doomed)
    return True


def _remove_doomed(path: str) -> None:
    st = os.lstat(path)
    if stat.S_ISDIR(st.st_mode):  # rmtree refuses a link itself, and does not follow those inside
        shutil.rmtree(path)


def finish_deletions(directory: str) -> None:
    """Remove what an interrupted `remove_checkpoint` left in `directory` (only real directories jdp renamed)."""
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for entry in os.scandir(directory):
            if entry.name.startswith(DELETING) and not entry.is_symlink():
                _remove_doomed(entry.path)


FIRST_FILES = ("metrics.jsonl", "checkpoints")  # what a run makes in its workdir before its first step


class MadeByRun:
    """What a run is about to make, taken back if it fails while they are still empty (before its
    first record or checkpoint, e.g. as the first step compiles): of `FIRST_FILES`, the workdir and
    its parents, those that do not exist yet (`active=False`: nothing, for every process but the one
    that writes). Only a run that held the workdir's lock removes anything (a run refused by it never
    touches what the live one made)."""

    def __init__(self, workdir: str, active: bool = True):
        self.files = [os.path.join(workdir, n) for n in FIRST_FILES if not os.path.lexists(os.path.join(workdir, n))]
        self.dirs, d = [], os.path.abspath(workdir)
        while active and not os.path.lexists(d) and os.path.dirname(d) != d:
            self.dirs.append(d)  # innermost first
            d = os.path.dirname(d)
        self.files = self.files if active else []
        self.held = False

    @contextlib.contextmanager
    def files_on_failure(self):
        """Inside the lock: if the block raises, remove the files made and left empty."""
        self.held = True
        try:
            yield
        except BaseException:
            remove_if_empty(self.files)
            raise

    @contextlib.contextmanager
    def dirs_on_failure(self):
        """Outside the lock (its file gone): if the block raises, remove the directories made and left empty."""
        try:
            yield
        except BaseException:
            if self.held:
                remove_if_empty(self.dirs)
            raise


def remove_if_empty(paths: list[str]) -> None:
    """Remove each of `paths` (in order) that is an empty directory or an empty regular file;
    anything that holds data, and any symlink, stays. Never follows a link."""
    for path in paths:
        try:
            st = os.lstat(path)
            if stat.S_ISDIR(st.st_mode):
                os.rmdir(path)  # refused if it is not empty
            elif stat.S_ISREG(st.st_mode) and st.st_size == 0:
                os.unlink(path)
        except OSError:
            continue


__all__ = ["DELETING", "FIRST_FILES", "MadeByRun", "SymlinkRefusedError", "finish_deletions", "is_jdp_checkpoint",
           "open_nofollow", "refuse_symlink", "refuse_symlinks_in", "refusal", "remove_checkpoint", "remove_if_empty"]
