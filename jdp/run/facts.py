"""A run's facts, computed once from its config (and its training data) into one frozen value.

What defines the run: its identity (`jdp.config.run_identity` plus a digest of the training data),
compared with every checkpoint's, and its hash. When it acts: the schedule rule (which steps log,
evaluate and checkpoint; whether train.steps may change on resume). What every process of a
multi-process run must agree on before its first step. The training loop, the checkpoints and the
agreement between processes all read this one value instead of asking the config again.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import jax

from jdp.run.checkpoint_faults import CheckpointMismatchError
from jdp.run.config import ADDED_DEFAULTS, HASH_EXCLUDED, Config, identity_hash, run_identity, schedule_uses_steps
from jdp.run.digests import with_data_digest


def itstime(step: int, every: int, total: int) -> bool:
    """Whether optimizer step `step` (1-based) is one to act on: every `every` steps and at the last
    step, `total`; `every=0` means only at the last. One rule for logging, evaluation and checkpoints."""
    return step == total or (every > 0 and step % every == 0)


@dataclass(frozen=True)
class RunFacts:
    """The run's identity, hash, schedule rule and agreed facts (JSON values; read, never changed)."""

    identity: dict  # `run_identity(config)`; `with_data` adds data.train_arrays_sha256
    config_hash: str  # sha256 (hex) of the identity without the data digest: `jdp.config.config_hash`
    steps: int  # train.steps: the run's last optimizer step
    log_every: int  # train.log_every (also how often processes share a stop request)
    eval_every: int  # train.eval_every
    checkpoint_every: int  # train.checkpoint_every
    steps_in_identity: bool  # the schedule uses train.steps: it may not change on resume
    schedule: str  # optim.schedule, named when a change of train.steps is refused
    agreed: dict  # what every process must pass equally to `jdp.run.distributed.agree` before its first step
    saved: dict  # what a checkpoint stores besides its identity: the whole config and the device count
    data_keys: tuple = ()  # the keys of `agreed` that `with_data` added: the data's sizes and digests

    @classmethod
    def of(cls, config: Config, devices=None, *, stop_after: int | None = None,
           fallback_to_intact: bool = False) -> RunFacts:
        """The facts of `config` trained on `devices` (the config's count of them, default all of jax's).

        `agreed` holds the run (`config_hash`) and every field that decides when a process enters a
        collective: logging and the stop-request check (train.log_every), checkpoints
        (train.checkpoint_every, keep_checkpoints), evaluations (train.eval_every,
        data.eval_batch_size), the step count (train.steps, `stop_after`), the non-finite stop
        (train.max_nonfinite), the layout (parallel.shard_optimizer_state, shard_params), the
        fallback's moves (`fallback_to_intact`), the global and this process's device counts, and every
        field of the identity (as `section.key`). Its keys are the config's dotted names, so a refusal
        names the field.
        """
        devices = list(devices or jax.devices())[:config.parallel.devices or None]
        d, t = config.to_dict(), config.train
        identity = run_identity(config)
        mine = sum(getattr(x, "process_index", 0) == jax.process_index() for x in devices)
        agreed = {dotted: d[dotted.split(".")[0]][dotted.split(".")[1]] for dotted in HASH_EXCLUDED}
        agreed |= {"config": identity_hash(identity), "train.steps": t.steps, "stop_after": stop_after,
                   "fallback_to_intact": fallback_to_intact, "devices": len(devices), "local devices": mine}
        # The identity's fields too, so that a refusal names the field (train.seed), not only the digest.
        agreed |= {f"{section}.{key}": value for section, fields in identity.items() for key, value in fields.items()}
        return cls(identity=identity, config_hash=agreed["config"], steps=t.steps, log_every=t.log_every,
                   eval_every=t.eval_every, checkpoint_every=t.checkpoint_every,
                   steps_in_identity=schedule_uses_steps(config), schedule=config.optim.schedule, agreed=agreed,
                   saved={"config": d, "devices": len(devices)})

    def with_data(self, train, test=None, *, paths: tuple = (None, None)) -> RunFacts:
        """These facts with the training data's digest in the identity, and both sets' sizes and digests
        agreed (`paths`: the files they were read from, if any, named when the processes differ)."""
        identity = with_data_digest(self.identity, train)
        digests = [identity["data"]["train_arrays_sha256"],
                   None if test is None else with_data_digest({}, test)["data"]["train_arrays_sha256"]]
        data = {"train_examples": len(train), "test_examples": 0 if test is None else len(test)}
        for what, path, digest in zip(("training data", "held-out data"), paths, digests):
            data[f"the {what}'s digest" + (f" (read from {path!r})" if path else "")] = digest
        return dataclasses.replace(self, identity=identity, agreed={**self.agreed, **data}, data_keys=tuple(data))

    def data_facts(self) -> dict:
        """The sizes and digests of the training and held-out sets, which every process must agree on once
        built: each host may read its own copy of a file, and a copy that differs would mix two corpora."""
        return {k: self.agreed[k] for k in self.data_keys}

    def logs_at(self, step: int, end: int) -> bool:
        """Whether step `step` of a run ending at `end` logs its training metrics."""
        return itstime(step, self.log_every, end)

    def evaluates_at(self, step: int, end: int) -> bool:
        """Whether step `step` of a run ending at `end` evaluates the held-out set."""
        return itstime(step, self.eval_every, end)

    def checkpoints_at(self, step: int, end: int) -> bool:
        """Whether step `step` of a run ending at `end` saves a checkpoint."""
        return itstime(step, self.checkpoint_every, end)

    def stop_check_every(self, processes: int) -> int:
        """How often (in steps) the processes all-gather a stop request: every step for one process,
        else every log step, at most every 10."""
        return 1 if processes == 1 else max(1, min(self.log_every, 10))

    def checkpoint_run(self, identity: dict | None = None) -> dict:
        """What a checkpoint stores as its "run": the identity it is compared by, the config, the devices."""
        return {"identity": copy.deepcopy(self.identity if identity is None else identity), **self.saved}

    def compared_with(self, saved: dict, directory: str) -> dict:
        """The checkpoint "run" to compare with a checkpoint of identity `saved` in `directory`.

        A change of train.steps alone, where the schedule uses it, is refused here with the reason
        (CheckpointMismatchError). Checkpoints of a jdp that always counted train.steps hold it also
        for a constant schedule: their number is taken as this run's, so that they too may be
        extended; checkpoints from before the `ADDED_DEFAULTS` fields resume where the run keeps
        those defaults.
        """
        identity = _as_in_older_checkpoint(self.identity, saved)
        saved_steps = saved.get("train", {}).get("steps")
        same_but_steps = {**identity, "train": {**identity["train"], "steps": saved_steps}}
        if saved_steps is None or same_but_steps != saved:
            return self.checkpoint_run(identity)  # nothing to say about train.steps; restore() names any difference
        if saved_steps != self.steps and self.steps_in_identity:
            raise CheckpointMismatchError(
                f"train.steps={self.steps} differs from the run's {saved_steps} in {directory!r}, and "
                f"optim.schedule={self.schedule!r} decays the learning rate to 0 at train.steps, so every "
                f"step's learning rate would change; use --steps {saved_steps}, or another --workdir to train "
                f"{self.steps} steps.")
        return self.checkpoint_run(same_but_steps)


def _as_in_older_checkpoint(identity: dict, saved: dict) -> dict:
    """`identity` without the fields a checkpoint of an earlier jdp lacks (`ADDED_DEFAULTS`) where
    this run keeps the value that jdp trained with; any other value still differs, and is refused."""
    identity = {section: dict(values) for section, values in identity.items()}
    for dotted, value in ADDED_DEFAULTS.items():
        section, key = dotted.split(".")
        if key not in saved.get(section, {}) and identity.get(section, {}).get(key, value) == value:
            identity.get(section, {}).pop(key, None)
    return identity


__all__ = ["RunFacts", "itstime"]
