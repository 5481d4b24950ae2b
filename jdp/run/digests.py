"""sha256 digests of a run's arrays and metadata: what a checkpoint records to be verified on
restore, and the training data's part of a run's identity."""
from __future__ import annotations

import hashlib
import json

import jax
import numpy as np

_HASH_CHUNK = 1 << 24  # bytes hashed at a time: a strided view (char windows) is copied a chunk at a time


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


def json_digest(value) -> str:
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
