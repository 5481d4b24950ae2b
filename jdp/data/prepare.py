"""Token files from a text: what `jdp data prepare-tokens INPUT OUTPUT` runs.

    jdp data prepare-tokens python-reference runs/pyref_tokens     # the text that ships with Python
    jdp data prepare-tokens my_corpus.txt runs/mine --val-fraction 0.05 --dtype uint16

writes `OUTPUT/train.bin` and `OUTPUT/val.bin` in the format `jdp.data.load_tokens` reads
(nanoGPT's): token ids one after another, each a little-endian unsigned integer of `--dtype`
(uint16 by default), no header. The tokenizer is the identity on bytes: each token is one byte of
the text's UTF-8 encoding, so the vocabulary is 256 ids (`data.vocab_size: 256`) and decoding is
`bytes(ids).decode("utf-8")`.

The split is made on characters, as `jdp.data.load_char_corpus` makes it: `val.bin` holds the last
`val_fraction` of the characters (rounded), `train.bin` the rest, each then encoded. INPUT
`python-reference` (unless a file of that name exists) is the text `load_char_corpus` reads (the
Python Language Reference's topics, `pydoc_data.topics`), so the two corpora hold the same
characters in the same split; nothing downloads. Files already in OUTPUT are never overwritten:
each file is written beside its final name and renamed into place.
"""
from __future__ import annotations

import os

import numpy as np

REFERENCE = "python-reference"  # INPUT naming the text that ships with Python
TOKEN_FILES = ("train.bin", "val.bin")
DTYPES = ("uint16", "uint32")  # a byte tokenizer's 256 ids fit either; uint16 is nanoGPT's (and load_tokens' default)


def byte_tokens(text: str, dtype: str = "uint16") -> np.ndarray:
    """The UTF-8 bytes of `text` as token ids of `dtype`, shape (bytes,)."""
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(dtype)


def read_input(source: str) -> str:
    """The text of `source`: a UTF-8 file, or `python-reference` (see the module's docstring)."""
    if source == REFERENCE and not os.path.exists(source):
        from jdp.data.datasets import reference_text

        return reference_text()
    if not os.path.isfile(source):
        raise ValueError(f"INPUT {source!r} is not a file; give a UTF-8 text file, or {REFERENCE!r} for the "
                         f"Python Language Reference text.")
    try:
        with open(source, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"INPUT {source!r} is not UTF-8 text ({e.reason} at byte {e.start}).") from None


def prepare_tokens(text: str, out: str, *, val_fraction: float = 0.1, dtype: str = "uint16") -> dict:
    """Write `out/train.bin` and `out/val.bin` (byte tokens of `dtype`); returns {name: (tokens, characters)}.

    Raises ValueError for a `val_fraction` outside (0, 1), a dtype not in DTYPES, or a token file
    that already exists in `out` (it is left as it is).
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"--val-fraction {val_fraction} must be strictly between 0 and 1.")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not a token dtype for byte tokens; use one of {', '.join(DTYPES)}.")
    existing = [os.path.join(out, name) for name in TOKEN_FILES if os.path.lexists(os.path.join(out, name))]
    if existing:
        raise ValueError(f"{existing[0]!r} already exists; choose another OUTPUT folder or delete the token files "
                         f"there first.")
    os.makedirs(out, exist_ok=True)
    n_train = int(round(len(text) * (1.0 - val_fraction)))
    counts = {}
    for name, part in zip(TOKEN_FILES, (text[:n_train], text[n_train:])):
        tokens = byte_tokens(part, dtype)
        path = os.path.join(out, name)
        tokens.astype(np.dtype(dtype).newbyteorder("<")).tofile(path + ".partial")
        os.replace(path + ".partial", path)  # a killed run leaves no half-written token file under its name
        counts[name] = (len(tokens), len(part))
    return counts


def prepare_from(source: str, out: str, *, val_fraction: float = 0.1, dtype: str = "uint16") -> str:
    """`prepare_tokens` on the text of `source` (`read_input`); returns the line that says what was written.
    ValueError, in one sentence, for bad input or a file that cannot be read or written."""
    try:
        counts = prepare_tokens(read_input(source), out, val_fraction=val_fraction, dtype=dtype)
    except OSError as e:  # an unreadable INPUT, an OUTPUT that cannot be created or written, a full disk
        raise ValueError(f"cannot prepare {out!r} from {source!r}: {e.strerror or e}"
                         + (f" ({e.filename!r})." if e.filename else ".")) from None
    (nt, ct), (nv, cv) = counts["train.bin"], counts["val.bin"]
    return (f"train.bin: {nt:,} tokens ({ct:,} characters); val.bin: {nv:,} tokens ({cv:,} characters); "
            f"vocab_size 256, dtype {dtype} -> {out}")


__all__ = ["DTYPES", "REFERENCE", "TOKEN_FILES", "byte_tokens", "prepare_from", "prepare_tokens", "read_input"]
