"""The text of `jdp data prepare-tokens`' INPUTs, read once, piece by piece, never whole.

An INPUT is a UTF-8 text file; a `.jsonl` file (one JSON object a line) whose `--field` (default
"text") of each record is taken, each followed by a newline; a glob pattern (`'corpus/*.txt'`, its
matches in sorted order; `**` matches folders too); `python-reference`, the Python Language
Reference's topics (`pydoc_data.topics`, the text `jdp.data.load_char_corpus` reads); or
`python-stdlib`, the `.py` files directly in the standard library's folder
(`sysconfig.get_paths()["stdlib"]`), in sorted order. A file of one of those two names wins.
The text is the INPUTs' texts one after another, as `cat` would join them. Line ends are read
as Python's text mode reads them: "\\r\\n" and "\\r" become "\\n".

`spool` reads each INPUT once (every file through `_read_blocks`), hashing the bytes it reads and
writing their text to one UTF-8 file, which the later passes read (`spooled_pieces`): an INPUT
replaced or still growing while it is read is hashed and encoded as it was read, never as two
different texts.
"""
from __future__ import annotations

import codecs
import glob
import hashlib
import io
import itertools
import json
import os
import sysconfig

from jdp.text import quoted

REFERENCE = "python-reference"  # INPUT naming the text that ships with Python (the Language Reference)
STDLIB = "python-stdlib"  # INPUT naming the standard library's own .py files
READ_BYTES = 1 << 20  # bytes read from a file at a time
GLOB_CHARS = "*?["


def stdlib_files() -> list[str]:
    """The `.py` files directly in the standard library's folder, sorted by name (168 on Python 3.11.7)."""
    return sorted(glob.glob(os.path.join(glob.escape(sysconfig.get_paths()["stdlib"]), "*.py")))


def expand_inputs(inputs: list[str]) -> list[str]:
    """The files (and named texts) the INPUTs stand for, in order; ValueError naming an INPUT that is none."""
    if not inputs:
        raise ValueError("no INPUT given; name a UTF-8 text or .jsonl file, a glob pattern, or python-reference.")
    out = []
    for spec in inputs:
        if os.path.isfile(spec):
            out.append(spec)
        elif spec == REFERENCE:
            out.append(REFERENCE)
        elif spec == STDLIB:
            out.extend(stdlib_files())
        elif os.path.isdir(spec):
            raise ValueError(f"INPUT {quoted(spec)} is a folder; name its files, e.g. "
                             f"{quoted(os.path.join(spec, '*.txt'))}.")
        elif any(c in spec for c in GLOB_CHARS):
            matches = sorted(p for p in glob.glob(spec, recursive=True) if os.path.isfile(p))
            if not matches:
                raise ValueError(f"INPUT {quoted(spec)} matches no file.")
            out.extend(matches)
        else:
            raise ValueError(f"INPUT {quoted(spec)} is not a file; give a UTF-8 text or .jsonl file, a glob pattern, "
                             f"or {REFERENCE!r} (the Python Language Reference text) or {STDLIB!r} (the standard "
                             f"library's .py files).")
    return out


def _reference_text() -> str:
    from jdp.data.datasets import reference_text

    return reference_text()


def _read_blocks(path: str, read_bytes: int):
    """The raw bytes of a file, `read_bytes` at a time: the one place an INPUT file is read (its
    digest and its text both come from these very blocks, so they cannot disagree)."""
    with open(path, "rb") as f:
        while block := f.read(read_bytes):
            yield block


def _file_pieces(path: str, digest, read_bytes: int):
    """The decoded text of a UTF-8 file, piece by piece, newlines translated as text mode does;
    `digest` (a hashlib object or None) is fed the raw bytes."""
    utf8 = codecs.getincrementaldecoder("utf-8")("strict")
    decoder = io.IncrementalNewlineDecoder(utf8, translate=True)
    consumed = 0
    for block in itertools.chain(_read_blocks(path, read_bytes), [b""]):  # the empty block ends the decoding
        if digest is not None:
            digest.update(block)
        pending = len(utf8.getstate()[0])
        try:
            piece = decoder.decode(block, final=not block)
        except UnicodeDecodeError as e:
            raise ValueError(f"INPUT {quoted(path)} is not UTF-8 text ({e.reason} at byte "
                             f"{consumed - pending + e.start}).") from None
        consumed += len(block)
        if piece:
            yield piece


def _lines(path: str, digest, read_bytes: int):
    """The lines of a file as bytes, each with its b"\\n" (the last perhaps without); `digest` is fed the raw bytes."""
    parts: list[bytes] = []  # the line being read (a long line is joined once, not copied per block)
    for block in _read_blocks(path, read_bytes):
        if digest is not None:
            digest.update(block)
        start = 0
        while (end := block.find(b"\n", start)) >= 0:
            parts.append(block[start:end + 1])
            yield b"".join(parts)
            parts, start = [], end + 1
        if start < len(block):
            parts.append(block[start:])
    if parts:
        yield b"".join(parts)


def _jsonl_pieces(path: str, field: str, digest, read_bytes: int):
    """Each record's `field` of a .jsonl file, then a newline; `digest` is fed the raw bytes."""
    for number, line in enumerate(_lines(path, digest, read_bytes), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (UnicodeDecodeError, ValueError) as e:
            raise ValueError(f"line {number} of INPUT {quoted(path)} is not a JSON object in UTF-8 "
                             f"({str(e).splitlines()[0]}).") from None
        text = record.get(field) if isinstance(record, dict) else None
        if not isinstance(text, str):
            what = "no field" if not isinstance(record, dict) or field not in record else "a non-string field"
            raise ValueError(f"line {number} of INPUT {quoted(path)} has {what} {field!r}; name the record's text "
                             f"field with --field.")
        yield text + "\n"


def input_pieces(path: str, *, field: str = "text", digest=None, read_bytes: int = READ_BYTES):
    """The text of one expanded INPUT (`expand_inputs`), piece by piece (str); see the module's docstring."""
    if path == REFERENCE and not os.path.isfile(path):
        text = _reference_text()
        if digest is not None:
            digest.update(text.encode("utf-8"))
        yield text
    elif path.lower().endswith(".jsonl"):
        yield from _jsonl_pieces(path, field, digest, read_bytes)
    else:
        yield from _file_pieces(path, digest, read_bytes)


def spool(paths: list[str], sink, *, field: str = "text", read_bytes: int = READ_BYTES) -> tuple[int, list[dict]]:
    """Read the INPUTs once, writing their text (UTF-8, newlines translated, .jsonl fields taken) to
    the binary file `sink`: (characters written, `[{"path", "sha256"}, ...]`), each sha256 of the
    very bytes read (of the UTF-8 text for python-reference). Raises ValueError for text that is
    not UTF-8, a .jsonl record without the field, or a file that cannot be read."""
    total, inputs = 0, []
    for path in paths:
        h = hashlib.sha256()
        pieces = input_pieces(path, field=field, digest=h, read_bytes=read_bytes)
        while True:
            try:
                piece = next(pieces, None)
            except OSError as e:  # the INPUT's (the sink's own errors, a full disk, are the caller's to say)
                raise ValueError(f"INPUT {quoted(path)} cannot be read ({e.strerror or e}).") from None
            if piece is None:
                break
            total += len(piece)
            sink.write(piece.encode("utf-8"))
        inputs.append({"path": path if path == REFERENCE else os.path.abspath(path), "sha256": h.hexdigest()})
    return total, inputs


def spooled_pieces(path: str, read_bytes: int = READ_BYTES):
    """The text `spool` wrote to `path`, piece by piece (str): decoded as written, nothing translated."""
    utf8 = codecs.getincrementaldecoder("utf-8")("strict")
    with open(path, "rb") as f:
        while True:
            block = f.read(read_bytes)
            piece = utf8.decode(block, final=not block)
            if piece:
                yield piece
            if not block:
                return


def split_pieces(pieces, n: int):
    """(the first n characters of the str iterable `pieces`, the rest), each an iterator of pieces;
    the second must be read after the first."""
    it, left = iter(pieces), []

    def head():
        count = 0
        for piece in it:
            if count + len(piece) >= n:
                yield piece[:n - count]
                left.append(piece[n - count:])
                return
            count += len(piece)
            yield piece

    def tail():
        yield from (p for p in left if p)
        yield from it

    return head(), tail()


def _cut(text: str) -> int:
    """Where `text` may be cut so that a GPT-2-style pre-tokenizer splits there anyway: before the
    last whitespace character that follows a non-whitespace one (none of GPT-2's pre-token patterns
    holds a non-space followed by a space: whitespace leads a pre-token, it never ends one). 0 if
    there is no such place."""
    for at in range(len(text) - 1, 0, -1):
        if text[at].isspace() and not text[at - 1].isspace():
            return at
    return 0


def chunks(pieces, size: int):
    """The concatenated `pieces` re-cut into strings of at most 2·size characters, each cut at the
    last place in its 2·size that `_cut` allows (at 2·size characters where there is none), so the
    chunks tokenize as the whole text does for GPT-2-style tokenizers. Holds about 2·size
    characters beyond the piece being read."""
    buffer = ""
    for piece in pieces:
        buffer, start = buffer + piece, 0
        while len(buffer) - start >= 2 * size:
            window = buffer[start:start + 2 * size]
            at = _cut(window) or len(window)
            yield window[:at]
            start += at
        buffer = buffer[start:]
    if buffer:
        yield buffer


__all__ = ["READ_BYTES", "REFERENCE", "STDLIB", "chunks", "expand_inputs", "input_pieces", "split_pieces", "spool",
           "spooled_pieces", "stdlib_files"]
