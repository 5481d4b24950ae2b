"""Replica consistency: every device must hold bit-identical params and optimizer state.

Data parallelism is exact only while the replicas agree; a single diverged copy (a missed
reduction, a non-deterministic op, a corrupted buffer) silently forks the model: every later step
starts from different weights on different devices, and nothing reports it.
"""
from __future__ import annotations

import jax
import numpy as np


class ReplicaMismatchError(AssertionError):
    """Raised by `check_replicas` when some device's copy of a leaf differs from device 0's."""


def _copies(x: jax.Array, stacked: bool) -> list[list[tuple[jax.Device, np.ndarray]]]:
    """The local copies of each part of `x`: one list of (device, value) per part that should agree."""
    if stacked:  # pmap layout: each device holds a (1, ...) slice of the (N, ...) leaf
        return [[(s.device, np.asarray(s.data)[0]) for s in x.addressable_shards]]
    parts = {}  # a replicated leaf is one part; a split one, one per block (hybrid sharding: copies per group)
    for s in x.addressable_shards:
        parts.setdefault(repr(s.index), []).append((s.device, np.asarray(s.data)))
    return list(parts.values())


def replica_mismatches(state) -> list[str]:
    """One line per leaf (or block of a split leaf) of `state` whose copies are not bit-identical on
    every local device that holds one.

    Compares raw bytes, so NaNs with equal bits count as equal and -0.0 differs from 0.0. The
    gradient accumulator of accum_sync="last" is per-device by design and is not compared. A leaf
    split over the devices (shard_optimizer_state, shard_params) has one copy of each block, except
    under hybrid sharding, where every replica group holds one: those copies are compared.
    """
    problems = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(state.replace(accum=None)):
        if not isinstance(leaf, jax.Array):
            continue
        for copies in _copies(leaf, state.stacked):
            problems += _differing(jax.tree_util.keystr(path), copies)
    return problems


def _differing(name: str, copies) -> list[str]:
    """A line for each copy that differs from the first."""
    problems = []
    ref_device, ref = copies[0]
    bad = [(d, a) for d, a in copies[1:] if a.shape != ref.shape or a.tobytes() != ref.tobytes()]
    for device, a in bad:
        diff = np.max(np.abs(a.astype(np.float64) - ref.astype(np.float64))) if a.shape == ref.shape else None
        problems.append(f"{name}: device {device.id} differs from device {ref_device.id}"
                        + (f" (max |Δ| {diff:.3g})" if diff is not None else f" (shape {a.shape} vs {ref.shape})"))
    return problems


def check_replicas(state) -> None:
    """Raise `ReplicaMismatchError` naming every leaf whose device copies are not bit-identical."""
    problems = replica_mismatches(state)
    if problems:
        raise ReplicaMismatchError(f"{len(problems)} replica mismatch(es): " + "; ".join(problems))
