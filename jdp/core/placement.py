"""The host side of a step's batches: each one checked, split into micro-batches and placed on the
devices (in a multi-process run, a process's slice of one global array)."""
from __future__ import annotations

import weakref

import jax
import numpy as np

from jdp.core.loss import batch_rows
from jdp.core.mesh import batch_sharded
from jdp.core.options import StepOptions


class Placement:
    """The host side of the step's batches: each one checked, split into micro-batches and placed on
    the devices (a process's slice of a global array in a multi-process run)."""

    def __init__(self, mesh, layout, options: StepOptions, local_devices: int, multi_process: bool):
        self.mesh, self.layout, self.options = mesh, layout, options
        self.local_devices, self.multi_process = local_devices, multi_process
        self._placed = weakref.WeakValueDictionary()  # arrays `place` produced, by id

    def place(self, batch):
        """`batch` validated and placed on the devices (`TrainStep.shard_batch`)."""
        leaves = jax.tree.leaves(batch)
        if leaves and all(self._placed.get(id(x)) is x for x in leaves):
            return batch  # this step's shard_batch placed it already: use it as is
        n = self.local_devices
        check_batch(batch, n, self.options.mask_key, "this process's" if self.multi_process else "")
        if self.multi_process:
            placed = jax.tree.map(lambda x: jax.make_array_from_process_local_data(batch_sharded(self.mesh),
                                                                                   np.asarray(x)), batch)
        else:
            placed = self.layout.place_batch(batch, n)
        for x in jax.tree.leaves(placed):  # remembered weakly, so pre-staged batches skip this next time
            self._placed[id(x)] = x
        return placed

    def micro_batches(self, global_batch) -> list:
        """The M micro-batches of a global batch (`TrainStep.micro_batches`)."""
        size, m, n = batch_rows(global_batch), self.options.accum_steps, self.local_devices
        if size % (m * n):
            raise ValueError(f"global batch size {size} is not accum_steps × devices × b = {m} × {n} × b "
                             f"for any whole b; use a multiple of {m * n}.")
        b = size // m
        return [jax.tree.map(lambda x: x[k * b:(k + 1) * b], global_batch) for k in range(m)]


def check_batch(batch, n: int, mask_key: str | None, whose: str = "") -> None:
    """Refuse, in one sentence, a batch that cannot make a call on `n` devices."""
    size = batch_rows(batch)
    if size == 0:
        raise ValueError("the global batch is empty (0 examples); a step needs at least one per device.")
    mask = batch.get(mask_key) if isinstance(batch, dict) and mask_key else None
    if isinstance(mask, np.ndarray) and not mask.any():  # a host mask costs nothing to check
        raise ValueError(f"batch[{mask_key!r}] marks no real example (all zeros); a call needs at least one, "
                         f"or the means over real examples divide by zero.")
    if size % n:
        raise ValueError(f"global batch size {size} does not divide evenly across {whose + ' ' if whose else ''}"
                         f"{n} devices; use a multiple of {n}.")
