"""Why a checkpoint is refused, as one sentence: the errors jdp raises for a checkpoint that cannot
be written (no space), read (damaged, unreadable, not permitted) or restored into this step
(another run's configuration, another model or optimizer), or that must not be saved (NaN/Inf).

`jdp.run.checkpoint` raises them; nothing here touches the disk except reading a checkpoint's
array metadata to name the structure it holds.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import pathlib
import re

import jax
import numpy as np
import orbax.checkpoint as ocp

from jdp.core.state import TrainState

# What orbax (and tensorstore beneath it) raise for a checkpoint it cannot read back: missing
# items or files (KeyError, FileNotFoundError), truncated JSON (ValueError), a metadata tree of
# another shape (ValueError), truncated array data (a bare Exception wrapping tensorstore's
# ValueError). Reading never modifies the checkpoint.
UNREADABLE = Exception


class CheckpointMismatchError(ValueError):
    """The checkpoint was written by a run with another configuration; it is left untouched."""


class DamagedCheckpointError(ValueError):
    """The checkpoint cannot be read back, or does not match the checksums recorded when it was saved.

    `finding` is the message without its advice (what a fallback logs as it skips the checkpoint).
    """

    def __init__(self, finding: str, advice: str):
        super().__init__(f"{finding}; {advice}")
        self.finding = finding


class CheckpointWriteError(OSError):
    """A checkpoint could not be written for lack of space (ENOSPC, EDQUOT, EFBIG); `strerror` is the
    one sentence, naming the directory and the space it needs. The earlier checkpoints are intact."""


# errno values meaning "no room for these bytes": a full disk, a quota, the file-size limit (RLIMIT_FSIZE).
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def out_of_space_code(error: BaseException) -> int | None:
    """The errno of `error` or its causes when it is a write that ran out of space, else None.

    Tensorstore reports the OS error inside a ValueError's text (`[os_error_code='28']`), or only as
    its status, `RESOURCE_EXHAUSTED: Error writing ...` (OCDBT's writer): that counts as ENOSPC.
    """
    for e in _chain(error):
        if isinstance(e, OSError) and e.errno in _NO_SPACE:
            return e.errno
        found = re.search(r"os_error_code='(\d+)'", str(e))
        if found and int(found.group(1)) in _NO_SPACE:
            return int(found.group(1))
        if found is None and re.search(r"RESOURCE_EXHAUSTED: (Error writing|Failed writing|Failed to write)", str(e)):
            return errno.ENOSPC  # tensorstore's status for a write with no room, when it names no OS error
    return None


def _megabytes(size: int) -> str:
    return f"{size / 1e6:.1f} MB" if size >= 1e5 else f"{size / 1e3:.0f} kB"


class _QuietOutOfSpace(logging.Filter):
    """Drops orbax's logged traceback of a save thread that ran out of space: jdp reports it in one sentence."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        error = record.exc_info[1] if record.exc_info else None
        return out_of_space_code(error or RuntimeError(record.getMessage())) is None


logging.getLogger("absl").addFilter(_QuietOutOfSpace())


class NonFiniteStateError(RuntimeError):
    """The state to checkpoint holds NaN/Inf; it was not saved, and the finite checkpoints are kept."""



def differences(saved: dict, current: dict, prefix: str = "") -> list[str]:
    keys = sorted(set(saved) | set(current))
    out = []
    for k in keys:
        a, b = saved.get(k, "<absent>"), current.get(k, "<absent>")
        if isinstance(a, dict) and isinstance(b, dict):
            out += differences(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}: checkpoint {a!r}, now {b!r}")
    return out


def _structure(tree) -> list[tuple[str, tuple]]:
    """`tree`'s array leaves as (path, shape), paths written alike for a live state (NamedTuples,
    tuples) and for orbax's metadata of it (dicts, lists): `0.mu.w` for both."""
    def name(key):
        for attribute in ("key", "name", "idx"):
            if hasattr(key, attribute):
                return str(getattr(key, attribute))
        return str(key)

    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return sorted((".".join(map(name, path)), tuple(getattr(leaf, "shape", ()))) for path, leaf in leaves)


def saved_tree(path: str):
    """The array metadata of the state saved at `path` (a checkpoint's `state` item), as a tree. Read by
    the item's handler: a Checkpointer would also look there for a step's metadata, which an item
    has none of, and log a warning for it on the console at every resume."""
    saved = ocp.StandardCheckpointHandler().metadata(pathlib.Path(path))
    return saved.tree if hasattr(saved, "tree") else saved


def _shown(structure: list[tuple[str, tuple]], most: int = 6) -> str:
    if not structure:
        return "no arrays"
    text = ", ".join(f"{path or '<root>'} {shape}" for path, shape in structure[:most])
    return text + (f", … ({len(structure)} arrays)" if len(structure) > most else "")

def _chain(error: BaseException) -> list[BaseException]:
    """`error` and the errors it was raised from, outermost first (orbax wraps tensorstore's)."""
    chain = [error]
    while (inner := chain[-1].__cause__ or chain[-1].__context__) is not None and inner not in chain:
        chain.append(inner)
    # json's parser raises JSONDecodeError while handling its own StopIteration: that is not a cause.
    return [e for e in chain if not isinstance(e, StopIteration)] or chain


@contextlib.contextmanager
def out_of_space(directory: str, writing: tuple[int | None, int]):
    """Turn orbax's (tensorstore's) error for a write that ran out of space into CheckpointWriteError;
    `writing`: (the checkpoint being written, its arrays' bytes)."""
    try:
        yield
    except Exception as e:
        code = out_of_space_code(e)
        if code is None:
            raise
        step_number, size = writing
        raise CheckpointWriteError(code, f"checkpoint {step_number} could not be written to {directory!r} "
                                   f"({os.strerror(code)}: a full disk, a quota or the file-size limit); it "
                                   f"needs about {_megabytes(size)} of free space (its arrays) in one file "
                                   f"system, and every checkpoint saved before it is intact") from None


class Diagnosis:
    """Why a checkpoint of `directory` cannot be restored, as the error to raise: damaged (a checksum),
    unreadable, not permitted, or holding another structure than the step's; each with its advice."""

    def __init__(self, directory: str, manager: ocp.CheckpointManager):
        self.directory, self._manager = directory, manager

    def advice(self, step_number: int) -> str:
        older = [s for s in self._manager.all_steps() if s < step_number]
        if not older:
            return "remove it or use another --workdir."
        return (f"rerun with --fallback-to-intact to resume from the newest intact older checkpoint (of "
                f"{', '.join(map(str, sorted(older)))}) and move this one to {self.directory + '.damaged'!r}, or "
                f"use another --workdir.")

    def damaged(self, step_number: int, what: str) -> DamagedCheckpointError:
        return DamagedCheckpointError(f"checkpoint {step_number} in {self.directory!r} is damaged: its {what} do not "
                                      f"match the sha256 recorded when it was saved", self.advice(step_number))

    def unreadable(self, step_number: int, error: BaseException) -> ValueError:
        """The error for a checkpoint that orbax cannot read back: not permitted to (a plain ValueError),
        or damaged, truncated or not jdp's (DamagedCheckpointError)."""
        chain = _chain(error)
        cause = chain[-1]  # the root cause says most
        text = cause.args[0] if isinstance(cause, KeyError) and cause.args else cause
        text = (str(text).strip().splitlines() or [""])[0].rstrip(".:") or "no details"
        text = text if len(text) <= 300 else text[:299] + "…"
        if any(isinstance(e, PermissionError) or "PERMISSION_DENIED" in str(e) for e in chain):
            return ValueError(f"checkpoint {step_number} in {self.directory!r} cannot be read ({text}); give this "
                              f"user read permission on it or use another --workdir.")
        return DamagedCheckpointError(f"checkpoint {step_number} in {self.directory!r} is unreadable "
                                      f"({type(cause).__name__}: {text})", self.advice(step_number))

    def other_structure(self, step_number: int, canonical: TrainState) -> CheckpointMismatchError | None:
        """The error for a readable checkpoint whose state has another structure than this step's (another
        optimizer, model or model state); None when the saved structure cannot be read or is the same."""
        try:
            saved = saved_tree(os.path.join(str(self._manager.directory), str(step_number), "state"))
        except UNREADABLE:
            return None
        if not (isinstance(saved, dict) and {"params", "opt_state"} <= saved.keys() and _structure(saved["params"])):
            return None  # a damaged or truncated state: not a question of structure
        # The params first: an optimizer state of another shape (Adam's moments have the params' shapes)
        # follows from another model, and the model is then what differs.
        for part, what in (("params", "params"), ("model_state", "a model state"), ("opt_state", "an optimizer state")):
            theirs, mine = _structure(saved.get(part) if isinstance(saved, dict) else None), _structure(
                getattr(canonical, part))
            if theirs != mine:
                return CheckpointMismatchError(
                    f"checkpoint {step_number} in {self.directory!r} holds {what} of another structure "
                    f"(checkpoint: {_shown(theirs)}; this step: {_shown(mine)}), so it was written with another "
                    f"{'optimizer' if part == 'opt_state' else 'model'}; restore it with the one it was trained "
                    f"with, or use another --workdir for this one.")
        return None



def check_finite(step_number: int, host: TrainState, newest: int | None) -> None:
    """Raise NonFiniteStateError if the params, optimizer or model state of `host` hold a NaN/Inf."""
    for name in ("params", "opt_state", "model_state"):
        for path, leaf in jax.tree_util.tree_flatten_with_path(getattr(host, name))[0]:
            leaf = np.asarray(leaf)
            if np.issubdtype(leaf.dtype, np.inexact) and not np.all(np.isfinite(leaf)):
                kept = ("no checkpoint was saved before it" if newest is None
                        else f"the newest checkpoint, step {newest}, is finite and kept")
                raise NonFiniteStateError(
                    f"training stopped at step {step_number}: its state holds NaN/Inf (first in "
                    f"{name}{jax.tree_util.keystr(path)}), so it was not checkpointed; {kept}.")
