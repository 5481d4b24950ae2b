"""Any random-access source as jdp's batches read it: a `grain.MapDataset` or anything with `__len__`
and `__getitem__(i) -> {key: numpy array}` (grain's data sources, a list of dicts, your own class).

A source in jdp's sense offers `len(source)`, `source[i]` (one example, a dict of fixed-shape
arrays), `source.take(indices)` (those examples stacked, `(k, ...)` per key), `source.spec()`
(`{key: (shape, dtype)}` of one example) and `source.digest()` (a short hash identifying its
content, for a run's identity). `as_source` wraps whatever the user gives into one:

- a dict of arrays or an `ArrayDataset` -> `ArrayDataset` (`jdp.data.arrays`);
- an object that already is a jdp source (`jdp.data.load_tokens`, `load_array_record`) -> itself;
- any other `__len__` + `__getitem__` object (a `grain.MapDataset`, with its `.map`/`.random_map`
  transforms) -> `ItemSource`, which reads examples one by one and checks each against example 0.
"""
from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import numpy as np

from jdp.data.arrays import ArrayDataset
from jdp.data.checks import describe

SOURCE_METHODS = ("take", "spec", "digest")  # what a source has beyond __len__ and __getitem__
DIGEST_ITEMS = 8  # examples hashed (evenly spaced, first and last included) by ItemSource.digest


def spec_of(item, where: str) -> dict[str, tuple[tuple, np.dtype]]:
    """`{key: (shape, dtype)}` of one example `item`; ValueError if it is not a non-empty dict of arrays."""
    if not isinstance(item, Mapping) or not item:
        raise ValueError(f"{where} is {describe(item)}; a source's items must be non-empty dicts of numpy arrays.")
    spec = {}
    for k, v in item.items():
        a = np.asarray(v)
        if a.dtype == object or a.dtype.kind not in "biuf":
            raise ValueError(f"{where} has {str(k)!r} of dtype {a.dtype}; items hold numeric or bool arrays.")
        spec[str(k)] = (a.shape, a.dtype)
    return spec


def _show(spec: dict) -> str:
    return ", ".join(f"{k!r}: {shape} {dtype}" for k, (shape, dtype) in spec.items())


def check_item(item, index: int, spec: dict) -> None:
    """Raise ValueError naming `index` and the key where `item` differs from `spec` (example 0's keys,
    shapes and dtypes)."""
    got = spec_of(item, f"item {index} of the source")
    if got == spec:
        return
    missing, extra = sorted(set(spec) - set(got)), sorted(set(got) - set(spec))
    if missing or extra:
        what = f"lacks the key {missing[0]!r}" if missing else f"has the extra key {extra[0]!r}"
        raise ValueError(f"item {index} of the source {what}; every item needs the keys of item 0 ({_show(spec)}).")
    key = next(k for k in spec if got[k] != spec[k])
    raise ValueError(f"item {index} of the source has {key!r} of shape {got[key][0]} and dtype {got[key][1]}, "
                     f"but item 0's is {spec[key][0]} {spec[key][1]}; every item needs item 0's shapes and dtypes.")


def stack_items(items: Sequence, indices: Sequence[int], spec: dict) -> dict[str, np.ndarray]:
    """The examples `items` (their source indices `indices`, for messages) checked against `spec` and
    stacked: `{key: array (k, *shape)}`."""
    for item, index in zip(items, indices):
        check_item(item, int(index), spec)
    return {k: np.stack([np.asarray(item[k]) for item in items]) for k in spec}


def sample_indices(n: int) -> list[int]:
    """DIGEST_ITEMS evenly spaced indices of [0, n), 0 and n - 1 included (fewer if n is small)."""
    return sorted({int(i) for i in np.linspace(0, n - 1, DIGEST_ITEMS)})


def digest_items(source, kind: str) -> str:
    """sha256 (hex) of `kind`, len(source) and DIGEST_ITEMS evenly spaced examples (keys, dtypes, shapes, bytes).

    Reads a handful of examples, never the whole source: it identifies a dataset and catches a
    changed length, format or sampled content, not an edit between the sampled examples.
    """
    n = len(source)
    h = hashlib.sha256(f"{kind}|{n}\n".encode())
    for i in sample_indices(n):
        for k, v in sorted(source[i].items()):
            a = np.ascontiguousarray(v)
            h.update(f"{i}|{k}|{a.dtype.str}|{a.shape}\n".encode())
            h.update(a.data)
    return h.hexdigest()


class ItemSource:
    """A random-access object (`__len__`, `__getitem__`) as a jdp source, its items checked against item 0.

    `take` reads the examples one by one (`items[i]` for each index) and stacks them; an item with
    another key, shape or dtype than item 0 raises ValueError naming its index and the key: for 8
    evenly spaced items when the source is made, for every item as its batch is read.
    """

    default_order = "bijection"

    def __init__(self, items):
        try:
            n = len(items)
        except TypeError:
            raise ValueError(f"a source needs __len__ and __getitem__ (e.g. a grain.MapDataset), got "
                             f"{describe(items)}.") from None
        if not hasattr(items, "__getitem__"):
            raise ValueError(f"a source needs __getitem__ as well as __len__, got {describe(items)}.")
        if n == 0:
            raise ValueError("the source is empty (len 0); it needs at least one example.")
        self.items = items
        self._spec = spec_of(items[0], "item 0 of the source")
        for i in sample_indices(n)[1:]:  # a bad source fails here, before a run writes anything
            check_item(items[i], i, self._spec)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict:
        return self.items[int(index)]

    def take(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """Examples `indices` (shape (k,)), checked against item 0 and stacked: `{key: (k, *shape)}`."""
        return stack_items([self.items[int(i)] for i in indices], indices, self._spec)

    def spec(self) -> dict[str, tuple[tuple, np.dtype]]:
        """`{key: (shape, dtype)}` of item 0, which every item must match."""
        return dict(self._spec)

    def digest(self) -> str:
        """`digest_items`: the length and 8 sampled items."""
        return digest_items(self, type(self.items).__name__)


def as_source(data):
    """`data` as a jdp source: a dict of arrays becomes an `ArrayDataset`, a jdp source stays itself,
    any other `__len__` + `__getitem__` object (a `grain.MapDataset`) becomes an `ItemSource`."""
    if isinstance(data, ArrayDataset):
        return data
    if isinstance(data, Mapping):
        return ArrayDataset(data)
    if all(hasattr(data, m) for m in ("__len__", "__getitem__", *SOURCE_METHODS)):
        return data
    return ItemSource(data)
