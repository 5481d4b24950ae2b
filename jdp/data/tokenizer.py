"""The tokenizer of a prepared data directory (`jdp data prepare-tokens`): bytes only.

`load_tokenizer(directory)` reads the directory's `meta.json` (`read_metadata`); a directory
without one holds byte tokens (each token one byte of the text's UTF-8 encoding, 256 ids).
"""
from __future__ import annotations

import json
import os

META = "meta.json"


class Tokenizer:
    """Text to token ids and back. `kind` "bytes": each id is one byte of the UTF-8 text (vocab_size 256)."""

    def __init__(self, kind: str = "bytes"):
        if kind != "bytes":
            raise ValueError(f"tokenizer kind {kind!r} is not supported here; only 'bytes' is.")
        self.kind, self.vocab_size = kind, 256

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of `text` as ids 0..255."""
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        """The text of `ids`; bytes that are not valid UTF-8 become U+FFFD."""
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def save(self, directory: str) -> None:
        """Nothing to write for bytes: a directory without metadata holds byte tokens."""


def read_metadata(directory: str) -> dict | None:
    """The parsed `directory/meta.json`, or None where there is none."""
    path = os.path.join(directory, META)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def load_tokenizer(directory: str) -> Tokenizer:
    """The tokenizer the token files of `directory` were written with (bytes without metadata)."""
    meta = read_metadata(directory)
    return Tokenizer((meta or {}).get("tokenizer", {}).get("kind", "bytes"))
