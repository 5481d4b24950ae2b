"""Orbax checkpoints of a whole run: train state, data position and the run's configuration.

The state is saved in its canonical form (one copy, `TrainStep.canonical`), so a run can resume
on another device count. Orbax writes each checkpoint to a temporary directory and renames it
when complete, so a crash mid-write never touches the newest complete checkpoint; `keep` bounds
how many are kept.
"""
from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp

from jdp.state import TrainState
from jdp.step import TrainStep


# What orbax (and tensorstore beneath it) raise for a checkpoint it cannot read back: missing
# items or files (KeyError, FileNotFoundError), truncated JSON (ValueError), a metadata tree of
# another shape (ValueError), truncated array data (a bare Exception wrapping tensorstore's
# ValueError). Reading never modifies the checkpoint.
_UNREADABLE = Exception


class CheckpointMismatchError(ValueError):
    """The checkpoint was written by a run with another configuration; it is left untouched."""


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


class Checkpointer:
    """Saves and restores `(state, data_state, run)` under `directory/<step>/`."""

    def __init__(self, directory: str, keep: int = 3):
        if os.path.exists(directory) and not os.path.isdir(directory):
            raise ValueError(f"checkpoint directory {directory!r} exists and is not a directory.")
        if keep < 1:
            raise ValueError(f"keep={keep} must be at least 1.")
        self.directory = os.path.abspath(directory)
        try:
            self._manager = ocp.CheckpointManager(
                self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))
        except OSError as e:  # a parent that is a file, no write permission, a read-only file system
            reason = f"{e.strerror}: {e.filename!r}" if e.strerror and e.filename else str(e)
            raise ValueError(f"checkpoint directory {self.directory!r} cannot be created ({reason}); "
                             f"use a --workdir you can write to.") from None

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's optimizer step, or None if there is none."""
        return self._manager.latest_step()

    def save(self, step_number: int, step: TrainStep, state: TrainState, data_state: dict, run: dict) -> None:
        """Checkpoint `state` after `step_number` optimizer steps, with the data position and `run`.

        `run` (JSON) must hold "identity": the configuration fields that define the run, compared on
        restore. Saving is asynchronous after the device-to-host copy; `wait()` blocks until done.
        """
        self._manager.save(step_number, args=ocp.args.Composite(
            state=ocp.args.StandardSave(step.canonical(state)),
            meta=ocp.args.JsonSave({"data_state": data_state, "run": run})))

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def run_info(self, step_number: int) -> dict:
        """The saved metadata ("data_state", "run") of a checkpoint."""
        try:
            meta = self._manager.restore(step_number, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
            if not (isinstance(meta, dict) and "data_state" in meta and isinstance(meta.get("run"), dict)
                    and "identity" in meta["run"]):
                raise KeyError("its metadata has no 'data_state' and 'run.identity', so jdp did not write it")
        except _UNREADABLE as e:
            raise self._unreadable(step_number, e) from None
        return meta

    def _unreadable(self, step_number: int, error: BaseException) -> ValueError:
        """The error for a checkpoint that orbax cannot read back (damaged, truncated or not jdp's)."""
        seen = {id(error)}
        while (inner := error.__cause__ or error.__context__) is not None and id(inner) not in seen:
            error = inner  # orbax wraps tensorstore's error in a bare Exception: the root cause says most
            seen.add(id(error))
        text = error.args[0] if isinstance(error, KeyError) and error.args else error
        text = (str(text).strip().splitlines() or [""])[0].rstrip(".:") or "no details"
        text = text if len(text) <= 300 else text[:299] + "…"
        return ValueError(f"checkpoint {step_number} in {self.directory!r} is unreadable ({type(error).__name__}: "
                          f"{text}); remove it or use another --workdir.")

    def restore(self, step: TrainStep, like: TrainState, run: dict,
                step_number: int | None = None) -> tuple[TrainState, dict, int]:
        """Restore the newest (or `step_number`) checkpoint into `step`'s layout.

        Returns `(state, data_state, step_number)`. Raises `CheckpointMismatchError`, naming every
        field that differs, when the checkpoint's run identity differs from `run["identity"]`, and
        ValueError when orbax cannot read it (damaged, truncated, not jdp's); it is never modified.
        """
        step_number = self.latest_step() if step_number is None else step_number
        if step_number is None:
            raise ValueError(f"no complete checkpoint in {self.directory!r}.")
        saved = self.run_info(step_number)
        diffs = _differences(saved["run"]["identity"], run["identity"])
        if diffs:
            raise CheckpointMismatchError(
                f"checkpoint {step_number} in {self.directory!r} was written by a different run ("
                + "; ".join(diffs) + "); use another --workdir or the original configuration.")
        canonical = step.canonical(like)
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), canonical)
        try:
            restored = self._manager.restore(step_number, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract)))
        except _UNREADABLE as e:
            raise self._unreadable(step_number, e) from None
        return step.place(restored.state, like), saved["data_state"], step_number

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()



def latest_params(workdir: str) -> tuple[int, Any]:
    """`(step, params)` of the newest complete checkpoint in `workdir/checkpoints`, as host numpy.

    Reads the saved arrays onto one local device, so it works whatever device count or process
    layout wrote them (e.g. to inspect or compare runs outside `jdp train`).
    """
    directory = os.path.join(workdir, "checkpoints")
    steps = [int(d) for d in os.listdir(directory) if d.isdigit()] if os.path.isdir(directory) else []
    if not steps:
        raise ValueError(f"no checkpoint in {directory!r}; run `jdp train ... --workdir {workdir}` first.")
    path = os.path.join(directory, str(max(steps)), "state")
    checkpointer = ocp.StandardCheckpointer()
    one_device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])  # saved on another topology
    abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one_device),
                            checkpointer.metadata(path).item_metadata)
    return max(steps), jax.device_get(checkpointer.restore(path, abstract)["params"])
