"""The device mesh: one named data axis, and the shardings of replicated and batch-sharded values."""
from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

DATA_AXIS = "data"
"""The default name of the one mesh axis jdp reduces over (`axis_name=` changes it); every collective names it."""


def make_mesh(devices: Sequence[jax.Device] | None = None, axis_name: str = DATA_AXIS) -> Mesh:
    """A 1-D mesh of `devices` (default: all devices; `jax.Device`s or their integer ids) along one axis,
    `axis_name` (default `DATA_AXIS`; e.g. "batch" for code that already reduces over that name).

    Built with `Mesh(...)` rather than `jax.make_mesh`, whose axes are Explicit: jdp's values are
    either fully replicated or split along the batch, which Auto axes express directly.
    """
    devices = [_device(d) for d in (jax.devices() if devices is None else devices)]
    if not devices:
        raise ValueError("devices is empty; pass None for all devices or a non-empty list.")
    if len({d.id for d in devices}) != len(devices):
        raise ValueError(f"devices {[d.id for d in devices]} contains duplicates; each device may appear once.")
    return Mesh(np.array(devices), (axis_name,))


def _device(d) -> jax.Device:
    """`d` as a device: a `jax.Device` as it is, an int as the device with that id."""
    if isinstance(d, jax.Device):
        return d
    if isinstance(d, (int, np.integer)) and not isinstance(d, bool):
        found = [x for x in jax.devices() if x.id == d]
        if not found:
            raise ValueError(f"device id {d} does not exist; the ids are {[x.id for x in jax.devices()]}.")
        return found[0]
    raise ValueError(f"devices holds {d!r} ({type(d).__name__}); give jax.Device objects or their integer ids.")


def replicated(mesh: Mesh) -> NamedSharding:
    """Every device holds the whole value (params, optimizer state)."""
    return NamedSharding(mesh, P())


def batch_sharded(mesh: Mesh) -> NamedSharding:
    """The leading axis is split evenly over the mesh's axis (a global batch, or pmap's stacked copies)."""
    return NamedSharding(mesh, P(mesh.axis_names[0]))
