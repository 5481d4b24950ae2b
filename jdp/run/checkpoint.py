"""Orbax checkpoints of a whole run: train state, data position and the run's configuration, verified.

The state is saved in its canonical form (one copy, `TrainStep.canonical`), so a run can resume
on another device count. Orbax writes each checkpoint to a temporary directory and renames it
when complete, so a crash mid-write never touches the newest complete checkpoint; `keep` bounds
how many are kept. Each checkpoint records the sha256 of its arrays and of its metadata (data
position and run identity); restoring verifies both and refuses a damaged checkpoint. A state
holding NaN/Inf is never saved, so rotation can only drop finite checkpoints for finite ones.
"""
from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import json
import logging
import os
import pathlib
import re
import tempfile
import weakref
from typing import Any, Callable

import jax
import numpy as np
import orbax.checkpoint as ocp

from jdp.core.state import TrainState
from jdp.core.step import TrainStep, get_tree
from jdp.run.workfiles import finish_deletions, refuse_symlink, refuse_symlinks_in, remove_checkpoint

# What orbax (and tensorstore beneath it) raise for a checkpoint it cannot read back: missing
# items or files (KeyError, FileNotFoundError), truncated JSON (ValueError), a metadata tree of
# another shape (ValueError), truncated array data (a bare Exception wrapping tensorstore's
# ValueError). Reading never modifies the checkpoint.
_UNREADABLE = Exception
_HASH_CHUNK = 1 << 24  # bytes hashed at a time: a strided view (char windows) is copied a chunk at a time


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


def _out_of_space_code(error: BaseException) -> int | None:
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
        return _out_of_space_code(error or RuntimeError(record.getMessage())) is None


logging.getLogger("absl").addFilter(_QuietOutOfSpace())


class NonFiniteStateError(RuntimeError):
    """The state to checkpoint holds NaN/Inf; it was not saved, and the finite checkpoints are kept."""


def tree_digest(tree) -> str:
    """sha256 (hex) of every array leaf of `tree`: its path, dtype, shape and bytes, in tree order.

    Costs one pass over the bytes (~1-2 GB/s) plus the copy of device arrays to the host.
    """
    h = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if jax.dtypes.issubdtype(getattr(leaf, "dtype", None), jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        a = np.asarray(leaf)
        h.update(f"{jax.tree_util.keystr(path)}|{a.dtype.str}|{a.shape}\n".encode())
        rows = a.reshape(1) if a.ndim == 0 else a
        block = max(1, _HASH_CHUNK // max(1, rows[:1].nbytes))  # rows per update
        for i in range(0, len(rows), block):
            h.update(np.ascontiguousarray(rows[i:i + block]).data)
    return h.hexdigest()


def _json_digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def with_data_digest(identity: dict, data) -> dict:
    """`identity` (a run identity) with `data.train_arrays_sha256`: the first 16 hex digits of a sha256
    of the training data, so resuming on other data is refused like any other difference.

    In-memory arrays (a dict of arrays, or anything with `.arrays`) are hashed whole (`tree_digest`);
    any other source by its own `digest()`, which reads a sample (a token file: its size, dtype,
    window settings and 16 blocks of 64 KiB; a grain or ArrayRecord source: its length and 8 items).
    """
    arrays = getattr(data, "arrays", data)
    digest = data.digest() if hasattr(data, "digest") and not hasattr(data, "arrays") else tree_digest(arrays)
    return {**identity, "data": {**identity.get("data", {}), "train_arrays_sha256": digest[:16]}}


def _differences(saved: dict, current: dict, prefix: str = "") -> list[str]:
    keys = sorted(set(saved) | set(current))
    out = []
    for k in keys:
        a, b = saved.get(k, "<absent>"), current.get(k, "<absent>")
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}{k}.")
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


def _saved_tree(path: str):
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


def _glob_safe(directory: str) -> tuple[str, Callable[[], None] | None]:
    """A path to `directory` that glob patterns cannot misread, and how to remove it (None: none made).

    Orbax finds a checkpoint's per-process array stores with etils' `Path.glob`, which joins the
    directory into the pattern: in `runs/sweep[1]` the `[1]` matches `1`, not `[1]`, so the arrays
    are silently left out of the checkpoint (and `*`, `?` can match other directories). A symlink
    in a fresh temporary directory stands in for such a directory.
    """
    if not glob.has_magic(directory):
        return directory, None
    parent = tempfile.mkdtemp(prefix="jdp-checkpoints-")
    alias = os.path.join(parent, "link")
    if glob.has_magic(alias):
        os.rmdir(parent)
        raise ValueError(f"checkpoint directory {directory!r} holds a glob character (*, ? or [) and so does the "
                         f"temporary directory {parent!r} jdp would link it from; set TMPDIR to a plain path.")
    os.symlink(directory, alias)
    return alias, lambda: (os.unlink(alias), os.rmdir(parent))


def _chain(error: BaseException) -> list[BaseException]:
    """`error` and the errors it was raised from, outermost first (orbax wraps tensorstore's)."""
    chain = [error]
    while (inner := chain[-1].__cause__ or chain[-1].__context__) is not None and inner not in chain:
        chain.append(inner)
    # json's parser raises JSONDecodeError while handling its own StopIteration: that is not a cause.
    return [e for e in chain if not isinstance(e, StopIteration)] or chain


@contextlib.contextmanager
def _out_of_space(directory: str, writing: tuple[int | None, int]):
    """Turn orbax's (tensorstore's) error for a write that ran out of space into CheckpointWriteError;
    `writing`: (the checkpoint being written, its arrays' bytes)."""
    try:
        yield
    except Exception as e:
        code = _out_of_space_code(e)
        if code is None:
            raise
        step_number, size = writing
        raise CheckpointWriteError(code, f"checkpoint {step_number} could not be written to {directory!r} "
                                   f"({os.strerror(code)}: a full disk, a quota or the file-size limit); it "
                                   f"needs about {_megabytes(size)} of free space (its arrays) in one file "
                                   f"system, and every checkpoint saved before it is intact") from None


class _Diagnosis:
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
            saved = _saved_tree(os.path.join(str(self._manager.directory), str(step_number), "state"))
        except _UNREADABLE:
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


class Checkpointer:
    """Saves and restores `(state, data_state, run)` under `directory/<step>/`, verified by checksums."""

    def __init__(self, directory: str, keep: int = 3):
        if os.path.exists(directory) and not os.path.isdir(directory):
            raise ValueError(f"checkpoint directory {directory!r} exists and is not a directory.")
        if keep < 1:
            raise ValueError(f"keep={keep} must be at least 1.")
        self.directory = os.path.abspath(directory)
        _check_access(self.directory)
        try:
            os.makedirs(self.directory, exist_ok=True)
            path, remove_alias = _glob_safe(self.directory)
        except OSError as e:  # a parent that is a file, no write permission, a read-only file system
            reason = f"{e.strerror}: {e.filename!r}" if e.strerror and e.filename else str(e)
            raise ValueError(f"checkpoint directory {self.directory!r} cannot be created ({reason}); "
                             f"use a --workdir you can write to.") from None
        self._remove_alias = weakref.finalize(self, remove_alias) if remove_alias else None
        refuse_symlinks_in(self.directory, "checkpoint directory")
        # jdp rotates itself (`_rotate`): orbax's max_to_keep would delete any step-named entry.
        self.keep = keep
        self._manager = ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(max_to_keep=None))
        self._diagnosis = _Diagnosis(self.directory, self._manager)
        self._writing = (None, 0)  # the checkpoint being saved and its bytes, for an out-of-space error

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's optimizer step, or None if there is none."""
        return self._manager.latest_step()

    def save(self, step_number: int, step: TrainStep, state: TrainState, data_state: dict, run: dict) -> None:
        """Checkpoint `state` after `step_number` optimizer steps, with the data position and `run`.

        `run` (JSON) must hold "identity": the configuration fields that define the run, compared on
        restore. Records the sha256 of the arrays and of the metadata. Raises NonFiniteStateError,
        saving nothing, if the params, optimizer state or model state hold a NaN/Inf. Saving is
        asynchronous after the device-to-host copy; `wait()` blocks until done.
        """
        canonical = step.canonical(state)
        host = jax.device_get(canonical)  # orbax copies to the host too; this copy is checksummed
        check_finite(step_number, host, self.latest_step())
        meta = {"data_state": data_state, "run": run}
        meta["checksums"] = {"state": tree_digest(host), "meta": _json_digest(meta)}
        self.wait()  # orbax would wait for the previous save too; then rotate before starting this one
        self._writing = (step_number, sum(np.asarray(x).nbytes for x in jax.tree.leaves(host)))
        with _out_of_space(self.directory, self._writing):
            self._manager.save(step_number, args=ocp.args.Composite(
                state=ocp.args.StandardSave(canonical), meta=ocp.args.JsonSave(meta)))

    def wait(self) -> None:
        """Block until every started save is complete on disk, then drop the checkpoints past `keep`.

        Raises CheckpointWriteError (an OSError) if a save ran out of space (a full disk, a quota,
        the file-size limit); the checkpoints saved before it are intact.
        """
        with _out_of_space(self.directory, self._writing):
            self._manager.wait_until_finished()
        self._rotate()

    def _rotate(self) -> None:
        """Delete all but the newest `keep` complete checkpoints (process 0), each only if it is
        provably jdp's (`jdp.run.workfiles.remove_checkpoint`); anything else in the directory is kept."""
        if jax.process_index() != 0:
            return
        finish_deletions(self.directory)
        steps = sorted(self._manager.all_steps())
        removed = [s for s in steps[:-self.keep] if remove_checkpoint(self.directory, str(s))]
        if removed:
            self._manager.reload()

    def run_info(self, step_number: int) -> dict:
        """The saved metadata ("data_state", "run", "checksums") of a checkpoint, verified."""
        try:
            meta = self._manager.restore(step_number, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
            if not (isinstance(meta, dict) and "data_state" in meta and isinstance(meta.get("run"), dict)
                    and "identity" in meta["run"]):
                raise KeyError("its metadata has no 'data_state' and 'run.identity', so jdp did not write it")
            if not isinstance(meta.get("checksums"), dict):
                raise KeyError("its metadata has no 'checksums', so a jdp that did not verify checkpoints wrote it")
        except _UNREADABLE as e:
            raise self._diagnosis.unreadable(step_number, e) from None
        if _json_digest({"data_state": meta["data_state"], "run": meta["run"]}) != meta["checksums"].get("meta"):
            raise self._diagnosis.damaged(step_number, "data position and run identity")
        return meta

    def _restore_verified(self, step: TrainStep, like: TrainState, run: dict, step_number: int) -> tuple:
        """(state, data_state) of checkpoint `step_number`, after checking its identity and checksums."""
        saved = self.run_info(step_number)
        diffs = _differences(saved["run"]["identity"], run["identity"])
        if diffs:
            raise CheckpointMismatchError(
                f"checkpoint {step_number} in {self.directory!r} was written by a different run ("
                + "; ".join(diffs) + "); use another --workdir or the original configuration.")
        canonical = step.canonical(like)
        other = self._diagnosis.other_structure(step_number, canonical)
        if other is not None:  # before orbax's restore, which fails on it with a trail of warnings
            raise other
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), canonical)
        try:
            restored = self._manager.restore(step_number, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract))).state
        except _UNREADABLE as e:
            found = self._diagnosis
            raise found.other_structure(step_number, canonical) or found.unreadable(step_number, e) from None
        if tree_digest(jax.device_get(restored)) != saved["checksums"].get("state"):
            raise self._diagnosis.damaged(step_number, "saved arrays")
        return restored, saved["data_state"]

    def restore(self, step: TrainStep, like: TrainState, run: dict, step_number: int | None = None, *,
                fallback_to_intact: bool = False, log: Callable[[str], Any] | None = None
                ) -> tuple[TrainState, dict, int]:
        """Restore the newest (or `step_number`) checkpoint into `step`'s layout, verified.

        Returns `(state, data_state, step_number)`. Raises `CheckpointMismatchError`, naming every
        field that differs, when the checkpoint's run identity differs from `run["identity"]`, and
        DamagedCheckpointError when it cannot be read or does not match its checksums; nothing on
        disk changes. With `fallback_to_intact`, a damaged checkpoint is instead skipped for the
        newest intact older one, and the damaged ones are moved (never deleted) to
        `directory + ".damaged"`, so that training on does not collide with or rotate to them.
        """
        step_number = self.latest_step() if step_number is None else step_number
        if step_number is None:
            raise ValueError(f"no complete checkpoint in {self.directory!r}.")
        damaged = []
        for candidate in [step_number, *sorted((s for s in self._manager.all_steps() if s < step_number),
                                               reverse=True)]:
            try:
                restored, data_state = self._restore_verified(step, like, run, candidate)
            except DamagedCheckpointError as e:
                if not fallback_to_intact:
                    raise
                (log or print)(f"{e.finding}; trying the one before it (--fallback-to-intact)")
                damaged.append(candidate)
                continue
            if damaged:
                set_aside(self.directory, damaged, log or print)
                self._manager.reload()
            return step.place(restored, like), data_state, candidate
        raise DamagedCheckpointError(f"no intact checkpoint in {self.directory!r}: checkpoints "
                                     f"{', '.join(map(str, damaged))} are all damaged", "remove them or use another "
                                     "--workdir.")

    def close(self) -> None:
        """Wait for the last save (and rotate), close orbax's manager and remove the glob-safe alias, if any."""
        try:
            self.wait()
        finally:
            self._manager.close()
            if self._remove_alias is not None:
                self._remove_alias()


def set_aside(directory: str, damaged: list[int], log: Callable[[str], Any]) -> None:
    """Move the damaged checkpoints of `directory` to `directory.damaged/`, never deleting them
    (process 0; the others wait for it)."""
    aside = directory + ".damaged"
    if jax.process_index() == 0:
        refuse_symlink(aside, "the directory for damaged checkpoints")
        os.makedirs(aside, exist_ok=True)
        for s in damaged:
            target, n = os.path.join(aside, str(s)), 1
            while os.path.lexists(target):  # an earlier fallback set aside the same step
                n += 1
                target = os.path.join(aside, f"{s}.{n}")
            os.rename(os.path.join(directory, str(s)), target)
        log(f"moved damaged checkpoint(s) {', '.join(map(str, damaged))} to {aside}")
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("jdp: damaged checkpoints set aside")


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


def _check_access(directory: str) -> None:
    """An existing checkpoint directory must be readable and writable: say which, before orbax fails."""
    if not os.path.isdir(directory):
        return
    if not os.access(directory, os.R_OK | os.X_OK):
        raise ValueError(f"checkpoint directory {directory!r} cannot be read (permission denied); give this user "
                         f"read permission on it or use another --workdir.")
    if not os.access(directory, os.W_OK):
        statvfs = os.statvfs(directory)
        reason = "read-only file system" if statvfs.f_flag & os.ST_RDONLY else "permission denied"
        raise ValueError(f"checkpoint directory {directory!r} cannot be written ({reason}); use a --workdir you "
                         f"can write to.")


def latest_params(workdir: str) -> tuple[int, Any]:
    """`(step, params)` of the newest complete checkpoint in `workdir/checkpoints`, as host numpy.

    Reads the saved arrays onto one local device, so it works whatever device count or process
    layout wrote them (e.g. to inspect or compare runs outside `jdp train`).
    """
    directory = os.path.abspath(os.path.join(workdir, "checkpoints"))  # orbax wants an absolute path
    steps = [int(d) for d in os.listdir(directory) if d.isdigit()] if os.path.isdir(directory) else []
    if not steps:
        raise ValueError(f"no checkpoint in {directory!r}; run `jdp train ... --workdir {workdir}` first.")
    path, remove_alias = _glob_safe(os.path.join(directory, str(max(steps)), "state"))
    try:
        one_device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])  # saved on another topology
        abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one_device),
                                _saved_tree(path))
        return max(steps), jax.device_get(ocp.StandardCheckpointer().restore(path, abstract)["params"])
    finally:
        if remove_alias is not None:
            remove_alias()


def save_state(directory: str, step, state: TrainState, *, keep: int = 3) -> int:
    """Save `state` (any device count, pmap or shard_map) as a verified checkpoint in `directory`,
    numbered by its optimizer step, and wait until it is on disk; returns that number.

    For research loops: `jdp.restore_state(directory, step, like)` reads it back, also into a step
    on another device count. Take it at an optimizer-step boundary (the accumulator is not saved).
    """
    number = int(np.asarray(get_tree(state, state.step)))
    checkpoints = Checkpointer(directory, keep=keep)
    try:
        checkpoints.save(number, step, state, {}, {"identity": {}})
    finally:
        checkpoints.close()
    return number


def restore_state(directory: str, step, like: TrainState, step_number: int | None = None) -> TrainState:
    """The newest (or `step_number`) checkpoint of `directory`, verified and placed in `step`'s layout.

    `like` is any state of `step` (e.g. `step.init(...)`): it gives the structure, so the caller
    builds no abstract tree. The checkpoint may come from another device count or backend.
    """
    checkpoints = Checkpointer(directory)
    try:
        return checkpoints.restore(step, like, {"identity": {}}, step_number)[0]
    finally:
        checkpoints.close()
