"""A user's `.npy`/`.npz` arrays, read with every header checked against the file before numpy allocates.

`np.load` allocates an array from the shape its header states before it reads any data, so a
damaged or hostile file whose header claims 2^40 elements makes it ask for terabytes. Here each
header is read first (`numpy.lib.format`) and the bytes it claims are compared with what the file
can hold: the rest of a `.npy` file; for an `.npz` member, its uncompressed size in the archive,
itself at most its compressed size (stored) or 1032 times it (deflate's largest ratio), and the
compressed size at most the archive's. The arrays together must also fit in the machine's memory.
"""
from __future__ import annotations

import math
import os
import zipfile

import numpy as np

from jdp.text import quoted, shorten

# The most bytes one compressed byte of a member can expand to, by zip method (deflate: 1032).
_RATIO = {zipfile.ZIP_STORED: 1, zipfile.ZIP_DEFLATED: 1032}
_MAGIC = np.lib.format.MAGIC_PREFIX  # the first bytes of numpy's array format


def memory_bytes() -> int | None:
    """This machine's physical memory in bytes, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def _size(n: int) -> str:
    """A byte count for people: 16 bytes, 3.0 KiB, ..., 4.0 TiB."""
    if n < 1024:
        return f"{n} byte{'s' * (n != 1)}"
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        n /= 1024
        if n < 1024:
            return f"{n:.1f} {unit}"
    return "more than 1024 PiB"


def _header(f, name: str, size: int) -> list[tuple]:
    """`[(name, shape, dtype, bytes after the header)]` of the array file `f` of `size` bytes; [] if not numpy's."""
    head = f.read(len(_MAGIC) + 2)
    if len(head) < len(_MAGIC) + 2 or not head.startswith(_MAGIC):
        return []  # not numpy's format: np.load refuses it with its own message
    # Format 3.0 differs from 2.0 only in its header's encoding (UTF-8 for non-Latin-1 field names),
    # which does not change the shape or the item size read here.
    read = np.lib.format.read_array_header_1_0 if head[-2:] == b"\x01\x00" else np.lib.format.read_array_header_2_0
    shape, _, dtype = read(f)
    return [(name, shape, dtype, size - f.tell())]


def _headers(path: str, suffix: str, key: str) -> list[tuple]:
    """`_header` of the `.npy` file (its array named `key`) or of every member of the `.npz` file at `path`."""
    if suffix == ".npy":
        with open(path, "rb") as f:
            return _header(f, key, os.path.getsize(path))
    archive, found = os.path.getsize(path), []
    with zipfile.ZipFile(path) as zf:
        for info in zf.infolist():
            ratio = _RATIO.get(info.compress_type)  # another method: only the memory bound below applies
            size = info.file_size if ratio is None else min(info.file_size, ratio * min(info.compress_size, archive))
            with zf.open(info) as f:
                found += _header(f, info.filename.removesuffix(".npy"), size)
    return found


def _check(where: str, headers: list[tuple]) -> None:
    """Refuse an object array, an array claiming more bytes than its file holds, or arrays beyond memory."""
    total = 0
    for name, shape, dtype, room in headers:
        if dtype.hasobject:
            raise ValueError(f"{where} holds an object array {quoted(name)}, which numpy stores as a pickle and "
                             f"allow_pickle=False refuses to load; save numeric arrays instead.")
        claimed = math.prod(shape) * dtype.itemsize
        if claimed > room:
            raise ValueError(f"{where} array {quoted(name)} claims shape {shorten(str(shape))} of {dtype} "
                             f"({_size(claimed)}), but the file holds at most {_size(max(room, 0))} of it; the file "
                             f"is damaged or was not written by numpy.")
        total += claimed
    memory = memory_bytes()
    if memory is not None and total > memory:
        raise ValueError(f"{where} holds {_size(total)} of arrays, more than this machine's {_size(memory)} of "
                         f"memory; load a part of it.")


def read_arrays(path: str | os.PathLike, *, key: str = "x") -> dict[str, np.ndarray]:
    """The arrays of a `.npz` file (by name) or a `.npy` file (one array, named `key`), with `allow_pickle=False`.

    Every header is checked before numpy allocates (see the module's docstring). Raises ValueError
    for a missing file, another suffix, an object array (numpy pickles those), a header claiming
    more than its file holds or than the machine's memory, or a file that is not numpy's format.
    """
    path = os.fspath(path)
    where = quoted(path)
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in (".npz", ".npy"):
        raise ValueError(f"{where} is neither a .npz nor a .npy file.")
    if not os.path.isfile(path):
        raise ValueError(f"no such file: {where}.")
    if suffix == ".npz" and not zipfile.is_zipfile(path):  # numpy would try to unpickle it, and refuse
        raise ValueError(f"{where} is not a valid .npz file (it is not a zip archive, which numpy.savez writes).")
    try:
        headers = _headers(path, suffix, key)
    except (ValueError, OSError, EOFError, RuntimeError, NotImplementedError, zipfile.BadZipFile) as e:
        raise ValueError(f"{where} is not a valid {suffix} file ({shorten(str(e))}).") from None
    _check(where, headers)
    try:
        if suffix == ".npy":
            return {key: np.load(path, allow_pickle=False)}
        with np.load(path, allow_pickle=False) as npz:
            return {name: npz[name] for name in npz.files}
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as e:
        raise ValueError(f"{where} is not a valid {suffix} file ({shorten(str(e))}).") from None
