"""Token files as a source: a flat binary file of token ids (nanoGPT's `train.bin`/`val.bin`), read window by window.

The format in one sentence: the file is the token ids of the corpus, one after another, each an
unsigned integer of `dtype` (uint16 by default) in the machine's byte order, with no header.

Windows: with N tokens, context length T and stride s (default T), example i is the window that
starts at token i·s: `x = tokens[i·s : i·s + T]`, `y = tokens[i·s + 1 : i·s + T + 1]` (x shifted
by one token), both int32 of shape (T,). There are m = (N - T - 1) // s + 1 windows; with s = T
they tile the file without overlap, so one epoch (m windows in the epoch's order) predicts every
token from position 1 to m·T exactly once; the last (N - 1) mod T tokens are never targets, and
token 0 never is (it has no predecessor).

The file is never read whole: it is opened once and each batch reads only its windows (one
`os.pread` each), so the process's anonymous memory (RssAnon) does not grow with the file. Reads,
not a memory map: a map of a file that shrinks under it kills the process with SIGBUS, with no
Python exception; here every batch compares the file's size with the size it had when opened and
a changed file raises `TokenFileChangedError`, naming both sizes.
"""
from __future__ import annotations

import hashlib
import os
import weakref

import numpy as np

from jdp.data.checks import check_int
from jdp.text import quoted

TOKEN_DTYPES = ("uint8", "uint16", "uint32")
DTYPE_IDS = {"uint8": 1 << 8, "uint16": 1 << 16, "uint32": 1 << 32}  # how many ids each dtype can hold
SAMPLE_BLOCKS = 32  # blocks of SAMPLE_TOKENS token ids checked against vocab_size when the file is opened
SAMPLE_TOKENS = 4096
DIGEST_BLOCKS = 16  # blocks of DIGEST_BYTES hashed by digest(), evenly spaced, the first and last included
DIGEST_BYTES = 1 << 16


def _dtype(dtype) -> np.dtype:
    name = np.dtype(dtype).name if isinstance(dtype, (np.dtype, type)) else dtype
    if name not in TOKEN_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not a token dtype; use one of {', '.join(map(repr, TOKEN_DTYPES))}.")
    return np.dtype(name)


class TokenFileChangedError(ValueError):
    """The token file's size changed after it was opened (rewritten under the run): its windows are no longer those trained on."""


def _check_vocab_fits(dtype: np.dtype, vocab_size: int, where: str) -> None:
    """A file of `dtype` ids cannot hold ids up to vocab_size - 1 beyond the dtype's range: the file is
    then probably of a wider dtype (a uint16 file of GPT-2 ids read as uint8 trains on byte pairs)."""
    if vocab_size > DTYPE_IDS[dtype.name]:
        wider = next(name for name in TOKEN_DTYPES if DTYPE_IDS[name] >= vocab_size)
        raise ValueError(f"a {dtype.name} token file cannot hold ids up to vocab_size - 1 = {vocab_size - 1} (at "
                         f"most {DTYPE_IDS[dtype.name] - 1}), so {where} is probably {wider}; set data.dtype "
                         f"(dtype=) to the dtype it was written in.")


class TokenWindows:
    """(x, y) windows over a token file: `{"x": (T,), "y": (T,)}` int32, see the module's docstring."""

    default_order = "bijection"

    def __init__(self, path: str | os.PathLike, *, context_length: int, dtype="uint16", stride: int | None = None,
                 vocab_size: int | None = None):
        self.path = os.fspath(path)
        self.dtype = _dtype(dtype)
        self.context_length = check_int("context_length", context_length, 1)
        self.stride = self.context_length if stride is None else check_int("stride", stride, 1)
        self.vocab_size = None if vocab_size is None else check_int("vocab_size", vocab_size, 1)
        where = quoted(self.path)
        if self.vocab_size is not None:
            _check_vocab_fits(self.dtype, self.vocab_size, f"the token file {where}")
        if not os.path.isfile(self.path):
            raise ValueError(f"no such token file: {where}.")
        self._fd = self._open()
        size = self.size = os.fstat(self._fd).st_size
        if size % self.dtype.itemsize:
            raise ValueError(f"token file {where} holds {size} bytes, not a whole number of {self.dtype.name} tokens "
                             f"({self.dtype.itemsize} bytes each); it is damaged or holds another dtype.")
        self.num_tokens = size // self.dtype.itemsize
        if self.num_tokens < self.context_length + 1:
            raise ValueError(f"token file {where} holds {self.num_tokens} tokens, fewer than one window of "
                             f"context_length + 1 = {self.context_length + 1} tokens.")
        if self.vocab_size is not None:
            self._check_sample()

    def _open(self) -> int:
        """A descriptor of the file, open for reading (closed with this object); any OSError (permission,
        I/O) as one sentence naming the file."""
        try:
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as e:
            raise ValueError(f"token file {quoted(self.path)} cannot be opened ({e.strerror or e}); give this "
                             f"user read permission on it, or name another data file.") from None
        weakref.finalize(self, os.close, fd)
        return fd

    def __getstate__(self):  # a worker process reopens the file instead of receiving the open one
        return {**self.__dict__, "_fd": None}

    def read(self, start: int, count: int) -> np.ndarray:
        """Tokens `start .. start + count - 1` of the file, (count,) of its dtype; TokenFileChangedError if
        the file no longer holds them."""
        size = self.dtype.itemsize
        return np.frombuffer(self._read_bytes(np.array([start * size]), count * size), self.dtype)

    def _read_bytes(self, offsets: np.ndarray, size: int) -> bytes:
        """`size` bytes from each byte offset of `offsets`, concatenated, after checking the file's size:
        a file that is no longer the one opened (another size, or a short read) raises TokenFileChangedError."""
        if self._fd is None:
            self._fd = self._open()
        fd = self._fd
        if os.fstat(fd).st_size == self.size:
            chunks = [os.pread(fd, size, int(offset)) for offset in offsets]
            if all(len(chunk) == size for chunk in chunks):
                return b"".join(chunks)
        self._changed(os.fstat(fd).st_size)

    def _changed(self, now: int):
        raise TokenFileChangedError(
            f"token file {quoted(self.path)} changed while the run read it: it held {self.size} bytes when opened "
            f"and holds {now} now (was it rewritten, e.g. tokenized again?); its windows are no longer those "
            f"trained on: train on the new file in another --workdir, or restore the old one to resume.")

    def __len__(self) -> int:
        """m = (N - T - 1) // stride + 1 windows."""
        return (self.num_tokens - self.context_length - 1) // self.stride + 1

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        """Window `index`: `{"x": (T,), "y": (T,)}` int32."""
        batch = self.take(np.array([index]))
        return {k: v[0] for k, v in batch.items()}

    def take(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """Windows `indices` (shape (k,)): `{"x", "y"}` int32 of shape (k, T), one read (`os.pread`) per window.

        With vocab_size set, a token id ≥ vocab_size in them raises ValueError naming its position.
        """
        indices = np.asarray(indices, np.int64)
        if indices.size and (indices.min() < 0 or indices.max() >= len(self)):
            raise ValueError(f"window indices must lie in [0, {len(self)}), got {indices.min()} to {indices.max()}.")
        starts = indices * self.stride
        raw = self._read_bytes(starts * self.dtype.itemsize, (self.context_length + 1) * self.dtype.itemsize)
        windows = np.frombuffer(raw, self.dtype).reshape(len(starts), self.context_length + 1)  # (k, T + 1)
        if self.vocab_size is not None and windows.size and windows.max() >= self.vocab_size:
            row, col = np.unravel_index(int(np.argmax(windows >= self.vocab_size)), windows.shape)
            self._bad_token(int(windows[row, col]), int(starts[row] + col))
        windows = windows.astype(np.int32)
        return {"x": windows[:, :-1], "y": windows[:, 1:]}

    def spec(self) -> dict[str, tuple[tuple, np.dtype]]:
        """`{"x": ((T,), int32), "y": ((T,), int32)}`."""
        shape = (self.context_length,)
        return {"x": (shape, np.dtype(np.int32)), "y": (shape, np.dtype(np.int32))}

    def _check_sample(self) -> None:
        """Token ids below vocab_size in SAMPLE_BLOCKS evenly spaced blocks (the first and last included)."""
        n, block = self.num_tokens, min(SAMPLE_TOKENS, self.num_tokens)
        for start in np.unique(np.linspace(0, n - block, SAMPLE_BLOCKS).astype(np.int64)):
            chunk = self.read(start, block)
            if chunk.max() >= self.vocab_size:
                at = int(np.argmax(chunk >= self.vocab_size))
                self._bad_token(int(chunk[at]), int(start) + at)

    def _bad_token(self, token: int, position: int):
        raise ValueError(f"token file {quoted(self.path)} holds the token id {token} at position {position}, not "
                         f"below vocab_size={self.vocab_size}; use the vocab_size the file was tokenized with "
                         f"(data.vocab_size) or the dtype it was written in (data.dtype).")

    def digest(self) -> str:
        """sha256 (hex) of the file's size, dtype, window settings and DIGEST_BLOCKS sampled 64 KiB blocks.

        Reads 1 MiB at most, whatever the file's size: it identifies the file and catches a changed size,
        dtype or window setting, or content changed in a sampled block; not an edit between the blocks.
        """
        size = self.num_tokens * self.dtype.itemsize
        h = hashlib.sha256(f"tokens|{size}|{self.dtype.str}|{self.context_length}|{self.stride}\n".encode())
        block = min(DIGEST_BYTES, size)
        starts = np.unique(np.linspace(0, size - block, DIGEST_BLOCKS).astype(np.int64))
        h.update(self._read_bytes(starts, block) if block else b"")
        return h.hexdigest()


def load_tokens(path: str | os.PathLike, *, context_length: int, dtype="uint16", stride: int | None = None,
                vocab_size: int | None = None) -> TokenWindows:
    """A flat token file (nanoGPT's `train.bin`) as a source of windows `{"x": (T,), "y": (T,)}` int32.

    `context_length` T; `stride` between window starts (default T: windows tile the file, see
    `jdp.data.tokens`); `dtype` of the file's ids: "uint8", "uint16" (nanoGPT's) or "uint32".
    With `vocab_size`, ids ≥ vocab_size are refused: in a sample of the file now, and in every
    batch as it is read; so is a `dtype` too narrow for them (uint8 with vocab_size > 256). Raises
    ValueError for a missing or unreadable file, a size that is not a whole number of tokens, a
    file shorter than one window (T + 1 tokens), or a sampled id ≥ vocab_size; reading a batch
    raises `TokenFileChangedError` (a ValueError) once the file's size differs from its size now.
    """
    return TokenWindows(path, context_length=context_length, dtype=dtype, stride=stride, vocab_size=vocab_size)
