"""An experiment tracker beside metrics.jsonl: Weights & Biases in offline mode (`jdp train --wandb`).

Offline mode writes the run into `workdir/wandb/offline-run-<time>-<id>/` and talks to no server;
`wandb sync workdir/wandb/offline-run-*` uploads it later, from any machine with network access.
The run's W&B id is the first 16 hex digits of its config hash (`jdp.run.facts.RunFacts.config_hash`),
so a resumed run syncs into the same W&B run, and its W&B config is the whole jdp config plus
`jdp.config_hash`, `jdp.devices` and `jdp.workdir`. Every record jdp logs (each log step's training
metrics, each evaluation) goes to `wandb.log` at its step. Needs the `wandb` extra.
"""
from __future__ import annotations

import os

from jdp.run.workfiles import refuse_symlink


class WandbOffline:
    """A W&B run in offline mode under `workdir/wandb`: `write(record)` per record, `close()` at the end."""

    def __init__(self, workdir: str, *, name: str, config: dict, config_hash: str, devices: int):
        from jdp.extras import require

        wandb = require("wandb", "wandb", "--wandb")
        refuse_symlink(os.path.join(workdir, "wandb"), "the W&B directory")
        os.environ.setdefault("WANDB_SILENT", "true")  # its banner would break the run's console lines
        self.run = wandb.init(mode="offline", dir=workdir, project="jdp", name=name, id=config_hash[:16],
                              resume="allow", config={**config, "jdp": {"config_hash": config_hash, "devices": devices,
                                                                         "workdir": os.path.abspath(workdir)}},
                              settings=wandb.Settings(console="off", x_disable_stats=True))

    def write(self, record: dict) -> None:
        """Every value of `record` except its "step", at that step."""
        self.run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def close(self) -> None:
        self.run.finish()


__all__ = ["WandbOffline"]
