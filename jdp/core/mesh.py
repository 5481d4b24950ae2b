"""The device mesh: one named data axis (or, for hybrid sharding, replica groups × the devices of a
group), and the shardings of replicated and batch-sharded values."""
from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

DATA_AXIS = "data"
"""The default name of the one mesh axis jdp reduces over (`axis_name=` changes it); every collective names it."""
REPLICA_AXIS, SHARD_AXIS = "replica", "shard"
"""Hybrid sharding's two mesh axes: the replica groups, and the devices of one group that split the state."""


def make_mesh(devices: Sequence[jax.Device] | None = None, axis_name: str = DATA_AXIS, replicas: int = 1) -> Mesh:
    """A 1-D mesh of `devices` (default: all devices; `jax.Device`s or their integer ids) along one axis,
    `axis_name` (default `DATA_AXIS`; e.g. "batch" for code that already reduces over that name).

    `replicas` > 1 (hybrid sharding): a 2-D mesh (`REPLICA_AXIS`, `SHARD_AXIS`) of `replicas` rows,
    row r the r-th consecutive N/replicas of `devices` once they are grouped by process (stably):
    with one replica per process of equal device counts, row r is process r's devices. Device d of
    that order sits at (d // G, d % G), G = N/replicas: the batch and the per-device keys are those
    of the 1-D mesh of the same order.

    Built with `Mesh(...)` rather than `jax.make_mesh`, whose axes are Explicit: jdp's values are
    either fully replicated or split along the batch, which Auto axes express directly.
    """
    devices = [_device(d) for d in (jax.devices() if devices is None else devices)]
    if not devices:
        raise ValueError("devices is empty; pass None for all devices or a non-empty list.")
    if len({d.id for d in devices}) != len(devices):
        raise ValueError(f"devices {[d.id for d in devices]} contains duplicates; each device may appear once.")
    if isinstance(replicas, bool) or not isinstance(replicas, (int, np.integer)) or replicas < 1:
        raise ValueError(f"replicas={replicas!r} must be a positive integer (1: no replica groups).")
    if len(devices) % replicas:
        raise ValueError(f"replicas={replicas} does not divide the {len(devices)} devices into equal groups; use a "
                         f"divisor of {len(devices)}.")
    if replicas == 1:
        return Mesh(np.array(devices), (axis_name,))
    by_process = sorted(devices, key=lambda d: d.process_index)  # a group's devices on one host where they can be
    return Mesh(np.array(by_process).reshape(int(replicas), -1), (REPLICA_AXIS, SHARD_AXIS))


def device_axes(axis_name: str = DATA_AXIS, replicas: int = 1) -> str | tuple[str, str]:
    """What a collective over every device of a step names: `axis_name`, or with `replicas` > 1 (hybrid
    sharding) both mesh axes, e.g. a synchronised BatchNorm's `axis_name`."""
    return (REPLICA_AXIS, SHARD_AXIS) if replicas > 1 else axis_name


def data_axes(mesh: Mesh) -> str | tuple[str, ...]:
    """The axis name (or, on a hybrid 2-D mesh, the tuple of names) that spans every device of `mesh`:
    what the batch is split along and what a reduction over all devices names."""
    return mesh.axis_names[0] if len(mesh.axis_names) == 1 else tuple(mesh.axis_names)


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
    return NamedSharding(mesh, P(data_axes(mesh)))


def users_mesh(mesh, devices, axis_name: str, backend: str, replicas: int) -> tuple[Mesh, str]:
    """`(mesh, the axis the batch is split over)` for `make_train_step(mesh=...)`: the caller's own mesh
    (any axis names and types, e.g. Flax's NNX language model example's Explicit ("fsdp", "tensor")),
    which backend="jit" runs the step on.

    The batch axis is `axis_name` where the mesh has it, else the mesh's one axis of more than one
    device (its other axes, of size 1, hold whole copies), else, on a one-device mesh, its first.
    Refused in one sentence: another backend, hybrid sharding's `replicas`, `devices` other than
    the mesh's, and a mesh with several axes of more than one device none of which is `axis_name`.
    """
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh={mesh!r} must be a jax.sharding.Mesh (e.g. jax.make_mesh((4, 1), ('fsdp', "
                         f"'tensor'))) or None.")
    if backend != "jit":
        raise ValueError(f"mesh= runs the step on the caller's mesh, which only backend='jit' does; "
                         f"backend={backend!r} builds its own 1-D mesh over `devices` (drop mesh, or use "
                         f"backend='jit').")
    if replicas != 1:
        raise ValueError(f"replicas={replicas} builds hybrid sharding's own ('replica', 'shard') mesh; give either "
                         f"replicas or mesh, not both.")
    if devices is not None and sorted(_device(d).id for d in devices) != sorted(d.id for d in mesh.devices.flat):
        raise ValueError(f"devices {[_device(d).id for d in devices]} are not the mesh's devices "
                         f"{[d.id for d in mesh.devices.flat]}; with mesh= drop devices (the mesh's are used).")
    if axis_name in mesh.axis_names:
        return mesh, axis_name
    wide = [a for a in mesh.axis_names if mesh.shape[a] > 1]
    if len(wide) > 1:
        raise ValueError(f"mesh {dict(mesh.shape)} has several axes of more than one device and none is "
                         f"axis_name={axis_name!r}; name the axis the batch is split over with axis_name=, one of "
                         f"{tuple(wide)}.")
    return mesh, (wide or list(mesh.axis_names))[0]
