"""Named host arrays as a source: `ArrayDataset` (in memory) and `load_arrays` (a user's .npz/.npy)."""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from jdp.data.checks import describe
from jdp.data.npyfile import read_arrays
from jdp.text import quoted, shorten


@dataclass(frozen=True)
class ArrayDataset:
    """Named host arrays that share a leading example axis: `arrays[k].shape == (n, ...)`, n ≥ 1.

    Its epoch order is numpy's `permutation(n)` (`jdp.data.epoch_order`), as before every other
    source existed, so runs on arrays keep their batches bit for bit.
    """

    arrays: Mapping[str, np.ndarray]
    default_order = "permutation"  # see jdp.data.order

    def __post_init__(self):
        if not isinstance(self.arrays, Mapping) or not self.arrays:
            raise ValueError(f"a dataset needs a non-empty dict of named arrays, got {describe(self.arrays)}.")
        arrays = {str(k): np.asarray(v) for k, v in self.arrays.items()}
        for k, v in arrays.items():
            if v.ndim == 0:
                raise ValueError(f"array {quoted(k)} is a scalar; every array needs a leading example axis.")
            if v.dtype == object:
                raise ValueError(f"array {quoted(k)} has dtype object; only numeric and bool arrays are allowed.")
        lengths = {k: len(v) for k, v in arrays.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"arrays have mismatched lengths {shorten(str(lengths))}; every array needs the same "
                             f"number of examples along axis 0.")
        if next(iter(lengths.values())) == 0:
            raise ValueError(f"the dataset is empty (0 examples in {shorten(str(sorted(arrays)))}); it needs at "
                             f"least one.")
        object.__setattr__(self, "arrays", arrays)

    def __len__(self) -> int:
        """The number of examples n."""
        return len(next(iter(self.arrays.values())))

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        """Example `index`: a dict of arrays of shape `arrays[k].shape[1:]`."""
        return {k: v[index] for k, v in self.arrays.items()}

    def take(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """Rows `indices` (shape (k,)) of every array: a dict of new arrays of shape (k, ...)."""
        return {k: v[indices] for k, v in self.arrays.items()}

    def spec(self) -> dict[str, tuple[tuple, np.dtype]]:
        """`{key: (shape of one example, dtype)}`."""
        return {k: (v.shape[1:], v.dtype) for k, v in self.arrays.items()}


def as_dataset(data: ArrayDataset | Mapping[str, np.ndarray]) -> ArrayDataset:
    """`data` as an ArrayDataset (a dict of arrays is wrapped and checked)."""
    return data if isinstance(data, ArrayDataset) else ArrayDataset(data)


def load_arrays(path: str | os.PathLike, *, key: str = "x") -> ArrayDataset:
    """A user's arrays from a `.npz` (every array it holds, by name) or `.npy` file (one array, named `key`).

    Read by `jdp.data.npyfile.read_arrays` (`allow_pickle=False`, every header checked against the file
    before numpy allocates). Raises ValueError for a missing file, another suffix, an object array
    (numpy pickles those), a header claiming more than its file holds or than the machine's memory,
    a file that is not numpy's format, or arrays of different lengths.
    """
    arrays = read_arrays(path, key=key)
    try:
        return ArrayDataset(arrays)
    except ValueError as e:
        raise ValueError(f"{quoted(os.fspath(path))}: {e}") from None
