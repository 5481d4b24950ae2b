"""Orbax checkpoints of a whole run: train state, data position and the run's configuration, verified.

The state is saved in its canonical form (one copy, `TrainStep.canonical`), so a run can resume
on another device count. Orbax writes each checkpoint to a temporary directory and renames it
when complete, so a crash mid-write never touches the newest complete checkpoint; `keep` bounds
how many are kept. Each checkpoint records the sha256 of its arrays and of its metadata (data
position and run identity); restoring verifies both and refuses a damaged checkpoint. A state
holding NaN/Inf is never saved, so rotation can only drop finite checkpoints for finite ones.
"""
from __future__ import annotations

import glob
import os
import tempfile
import weakref
from typing import Any, Callable

import jax
import numpy as np
import orbax.checkpoint as ocp

from jdp.core.state import TrainState
from jdp.core.step import TrainStep, get_tree
from jdp.run.checkpoint_faults import (UNREADABLE, CheckpointMismatchError, CheckpointWriteError, Diagnosis,
                                       DamagedCheckpointError, NonFiniteStateError, check_finite, differences,
                                       out_of_space, saved_tree)
from jdp.run.checkpoint_reading import newest_intact
from jdp.run.digests import json_digest, tree_digest, with_data_digest
from jdp.run.workfiles import finish_deletions, refuse_symlink, refuse_symlinks_in, remove_checkpoint

# The errors and the data digest are imported from here by the trainer, the CLI and users' code.
__all__ = ["CheckpointMismatchError", "CheckpointWriteError", "Checkpointer", "DamagedCheckpointError",
           "NonFiniteStateError", "latest_params", "restore_state", "save_state", "set_aside", "with_data_digest"]


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
        self._diagnosis = Diagnosis(self.directory, self._manager)
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
        meta["checksums"] = {"state": tree_digest(host), "meta": json_digest(meta)}
        self.wait()  # orbax would wait for the previous save too; then rotate before starting this one
        self._writing = (step_number, sum(np.asarray(x).nbytes for x in jax.tree.leaves(host)))
        with out_of_space(self.directory, self._writing):
            self._manager.save(step_number, args=ocp.args.Composite(
                state=ocp.args.StandardSave(canonical), meta=ocp.args.JsonSave(meta)))

    def wait(self) -> None:
        """Block until every started save is complete on disk, then drop the checkpoints past `keep`.

        Raises CheckpointWriteError (an OSError) if a save ran out of space (a full disk, a quota,
        the file-size limit); the checkpoints saved before it are intact.
        """
        with out_of_space(self.directory, self._writing):
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
        except UNREADABLE as e:
            raise self._diagnosis.unreadable(step_number, e) from None
        if json_digest({"data_state": meta["data_state"], "run": meta["run"]}) != meta["checksums"].get("meta"):
            raise self._diagnosis.damaged(step_number, "data position and run identity")
        return meta

    def _restore_verified(self, step: TrainStep, like: TrainState, run: dict, step_number: int) -> tuple:
        """(state, data_state) of checkpoint `step_number`, after checking its identity and checksums."""
        saved = self.run_info(step_number)
        diffs = differences(saved["run"]["identity"], run["identity"])
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
        except UNREADABLE as e:
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

    def steps_now(self) -> list[int]:
        """The complete checkpoints' optimizer steps as the directory holds them now (listed again: a
        running trainer may have saved or rotated some since this Checkpointer was made)."""
        self._manager.reload()
        return list(self._manager.all_steps())

    def newest_intact(self, step_for: Callable[[dict], tuple], log: Callable[[str], Any]) -> tuple:
        """Read the newest checkpoint that exists and is intact (its metadata and arrays match their
        sha256), without changing anything on disk (`jdp.run.checkpoint_reading.newest_intact`).

        `step_for(config)` gives `(step, like)` for the run's saved config (a dict; None in a checkpoint
        of a jdp that did not save it). Returns `(state, config, step_number)`; ValueError if none is intact.
        """
        return newest_intact(self, step_for, log)

    def close(self, *, wait: bool = True) -> None:
        """Wait for the last save (and rotate), close orbax's manager and remove the glob-safe alias, if any.
        `wait=False` (a reader that saved nothing): close without waiting or rotating."""
        try:
            if wait:
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
                                saved_tree(path))
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
