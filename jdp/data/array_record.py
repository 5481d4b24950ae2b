"""ArrayRecord files as a source, through grain's `ArrayRecordDataSource` (the `array-record` package:
`pip install 'jdp-train[arrayrecord]'`, or `pip install -e '.[arrayrecord]'` in a checkout; grain installs it too on Linux).

An ArrayRecord file holds records of bytes with an index, so record i is read without reading the
others. jdp's records are examples encoded by `encode_example`: the 4 bytes `JDP1`, a 4-byte
little-endian header length, a JSON header `[[key, dtype, shape], ...]`, then each array's bytes in
C order (no pickles; decoding is `np.frombuffer`, ~10x faster than numpy's `.npz` through
zipfile). Records in another format (a `tf.train.Example`, msgpack) are read with your own
`decode(bytes) -> {key: array}`.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

from jdp.data.sources import ItemSource, digest_items
from jdp.extras import install_command
from jdp.text import quoted

_MAGIC = b"JDP1"


def encode_example(example: Mapping[str, np.ndarray]) -> bytes:
    """One example `{key: array}` as bytes (see the module's docstring for the format)."""
    arrays = {str(k): np.asarray(v) for k, v in example.items()}  # tobytes() writes C order
    for k, a in arrays.items():
        if a.dtype.hasobject:
            raise ValueError(f"example key {k!r} has dtype object; records hold numeric or bool arrays.")
    header = json.dumps([[k, a.dtype.str, list(a.shape)] for k, a in arrays.items()]).encode()
    return b"".join([_MAGIC, len(header).to_bytes(4, "little"), header, *(a.tobytes() for a in arrays.values())])


def decode_example(record: bytes) -> dict[str, np.ndarray]:
    """The example `encode_example` wrote: `{key: array}` (read-only views of `record`)."""
    if record[:4] != _MAGIC:
        raise ValueError(f"a record starts with {bytes(record[:4])!r}, not jdp's {_MAGIC!r}: it was not written by "
                         f"write_array_record; pass load_array_record(..., decode=) for its format.")
    size = int.from_bytes(record[4:8], "little")
    offset, out = 8 + size, {}
    for key, dtype, shape in json.loads(record[8:offset]):
        dtype = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        out[key] = np.frombuffer(record, dtype, count, offset).reshape(tuple(shape))
        offset += count * dtype.itemsize
    return out


def _module(name: str):
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise ValueError(f"ArrayRecord files need the array-record package, which is not installed ({e}); "
                         f"install it with {install_command('arrayrecord')}.") from None


def write_array_record(path: str | os.PathLike, examples: Iterable[Mapping[str, np.ndarray]], *,
                       options: str = "group_size:1") -> int:
    """Write `examples` (dicts of arrays) to a new ArrayRecord file at `path`, one record each; returns the count.

    `options` are array-record's writer options; `group_size:1` keeps each record separately
    readable (the fastest random access).
    """
    writer = _module("array_record.python.array_record_module").ArrayRecordWriter(os.fspath(path), options)
    count = 0
    try:
        for example in examples:
            writer.write(encode_example(example))
            count += 1
    finally:
        writer.close()
    return count


class _Decoded(Sequence):
    """Records of an ArrayRecordDataSource, each decoded to a dict of arrays."""

    def __init__(self, records, decode: Callable[[bytes], Mapping]):
        self.records, self.decode = records, decode

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int):
        return self.decode(self.records[int(index)])


class ArrayRecordSource(ItemSource):
    """Examples decoded from ArrayRecord files: an `ItemSource` (every record checked against record 0)."""

    def __init__(self, paths: Sequence[str], decode: Callable[[bytes], Mapping]):
        self.paths = list(paths)
        records = _module("grain.python").ArrayRecordDataSource(self.paths)
        super().__init__(_Decoded(records, decode))

    def digest(self) -> str:
        """`digest_items` of the records (their count and 8 sampled decoded examples) and the files' sizes."""
        sizes = ",".join(str(os.path.getsize(p)) for p in self.paths)
        return digest_items(self, f"array_record|{sizes}")


def load_array_record(paths: str | os.PathLike | Sequence[str | os.PathLike], *,
                      decode: Callable[[bytes], Mapping] = decode_example) -> ArrayRecordSource:
    """ArrayRecord file(s) as a source: record i of their concatenation is example i, `decode(record)`.

    `decode` turns a record's bytes into `{key: array}` (default `decode_example`, the format
    `write_array_record` writes). Raises ValueError for a missing file, a file that is not an
    ArrayRecord file, no files, or when array-record is not installed.
    """
    paths = [os.fspath(paths)] if isinstance(paths, (str, os.PathLike)) else [os.fspath(p) for p in paths]
    if not paths:
        raise ValueError("load_array_record needs at least one path.")
    for p in paths:
        if not os.path.isfile(p):
            raise ValueError(f"no such ArrayRecord file: {quoted(p)}.")
    try:
        return ArrayRecordSource(paths, decode)
    except (RuntimeError, OSError) as e:  # array-record's reader refuses a file it cannot parse
        text = (str(e).strip().splitlines() or [""])[0][:200]
        raise ValueError(f"{', '.join(map(quoted, paths))} cannot be read as ArrayRecord ({text}).") from None
