"""The tokenizer of a prepared token folder: bytes, a byte-level BPE trained on the text, or a `tokenizer.json`.

`jdp data prepare-tokens INPUT... OUTPUT --tokenizer SPEC` (jdp.data.prepare) writes OUTPUT/meta.json
beside the token files; SPEC is one of

- `bytes` (the default): one token per UTF-8 byte, 256 ids, nothing to save;
- `bpe:VOCAB`: a byte-level BPE of VOCAB ids (GPT-2's pre-tokenizer and byte alphabet: 256 byte
  tokens, then merges) trained here on the training split's text, saved as OUTPUT/tokenizer.json;
- the path of a `tokenizer.json` (what a Hugging Face model folder holds), copied to OUTPUT.

meta.json: `{"vocab_size": int, "dtype": "uint16" | "uint32", "tokenizer": {"kind": "bytes" | "bpe" |
"file", "file": "tokenizer.json" | null, "spec": SPEC}, "encoder": {"engine": "bytes" | "tiktoken" |
"tokenizers", "version": str | null, "why": str}, "splits": {"train": {"tokens": int, "bytes": int,
"characters": int}, "val": {...}}, "inputs": [{"path": str, "sha256": str}, ...], "val_fraction":
float}` ("encoder": what encoded the text and why, `jdp.data.encoders`; absent in folders written
before it); a split's "bytes" are the UTF-8 bytes of the text its tokens encode (bits per byte =
loss per token × tokens / (ln 2 × bytes)). A folder without meta.json (token files written before
it existed) holds byte tokens. The BPE and file kinds need the `tokenizers` extra (Hugging Face's
Rust library); the bytes tokenizer needs nothing.
"""
from __future__ import annotations

import json
import os

import numpy as np

from jdp.text import quoted

META = "meta.json"
TOKENIZER_FILE = "tokenizer.json"
KINDS = ("bytes", "bpe", "file")
META_DTYPES = ("uint16", "uint32")
BPE_MIN_VOCAB = 257  # the 256 byte tokens and at least one merge
BPE_MAX_VOCAB = 1 << 20


def dtype_for(vocab_size: int) -> str:
    """The narrowest token dtype holding ids 0 .. vocab_size - 1: uint16 up to 65,536 ids, uint32 above."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def _tokenizers(what: str):
    from jdp.extras import require

    return require("tokenizers", "tokenizers", what)


class Tokenizer:
    """Text to token ids and back. `kind` is "bytes", "bpe" or "file"; ids lie in [0, vocab_size).

    `encode(text)` gives the ids of the text alone (no special tokens added); `decode(ids)` the
    text (bytes kind: the UTF-8 bytes decoded with errors="replace").
    """

    def __init__(self, kind: str, hf=None):
        if kind not in KINDS:
            raise ValueError(f"tokenizer kind {kind!r} is not one of {', '.join(KINDS)}.")
        if (hf is None) != (kind == "bytes"):
            raise ValueError(f"a {kind} tokenizer {'takes no' if kind == 'bytes' else 'needs a'} Hugging Face tokenizer.")
        self.kind, self._hf = kind, hf
        self.vocab_size = 256 if hf is None else max(hf.get_vocab(with_added_tokens=True).values()) + 1

    def encode(self, text: str) -> list[int]:
        """The token ids of `text`: (len,) ints in [0, vocab_size)."""
        if self._hf is None:
            return list(text.encode("utf-8"))
        return self._hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str], dtype: str = "uint32") -> np.ndarray:
        """The ids of the texts one after another, (total,) of `dtype`; the BPE and file kinds encode
        the texts in parallel (the Rust library's threads)."""
        if self._hf is None:
            return np.frombuffer("".join(texts).encode("utf-8"), np.uint8).astype(dtype)
        encode = getattr(self._hf, "encode_batch_fast", self._hf.encode_batch)  # _fast: no offsets kept
        parts = [np.asarray(e.ids, dtype) for e in encode(texts, add_special_tokens=False)]
        return np.concatenate(parts) if parts else np.zeros(0, dtype)

    def decode(self, ids) -> str:
        """The text of token ids `ids` (any int sequence or array)."""
        ids = [int(i) for i in np.asarray(ids).reshape(-1)]
        if self._hf is None:
            return bytes(ids).decode("utf-8", errors="replace")
        return self._hf.decode(ids, skip_special_tokens=False)

    def to_json(self) -> str | None:
        """The tokenizer.json text (None for bytes: there is nothing to save)."""
        return None if self._hf is None else self._hf.to_str()

    def save(self, directory) -> None:
        """Write `directory/tokenizer.json` (nothing for bytes); an existing file there is refused, never replaced."""
        text = self.to_json()
        if text is None:
            return
        path = os.path.join(os.fspath(directory), TOKENIZER_FILE)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
        except FileExistsError:
            raise ValueError(f"{quoted(path)} already exists; save the tokenizer into another folder.") from None
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)

    @classmethod
    def from_file(cls, path, kind: str = "file") -> "Tokenizer":
        """A tokenizer.json (Hugging Face's format) as a Tokenizer; ValueError in one sentence if it cannot be read."""
        tokenizers = _tokenizers(f"the tokenizer {quoted(os.fspath(path))}")
        if not os.path.isfile(path):
            raise ValueError(f"tokenizer file {quoted(os.fspath(path))} does not exist; give the path of a "
                             f"tokenizer.json.")
        try:
            return cls(kind, tokenizers.Tokenizer.from_file(os.fspath(path)))
        except Exception as e:  # the library raises its own Exception subclass for a malformed file
            raise ValueError(f"{quoted(os.fspath(path))} is not a tokenizer.json the tokenizers library reads "
                             f"({str(e).splitlines()[0] if str(e) else type(e).__name__}).") from None


def train_bpe(texts, vocab_size: int) -> Tokenizer:
    """A byte-level BPE of at most `vocab_size` ids trained on the strings of the iterable `texts`
    (read once, piece by piece): GPT-2's pre-tokenizer (no prefix space) and 256-byte alphabet, then
    merges; fewer ids if the text runs out of pairs to merge. Deterministic for a given text."""
    tk = _tokenizers("--tokenizer bpe:VOCAB")
    if not BPE_MIN_VOCAB <= vocab_size <= BPE_MAX_VOCAB:
        raise ValueError(f"--tokenizer bpe:{vocab_size}: VOCAB must be between {BPE_MIN_VOCAB} (the 256 bytes and "
                         f"a merge) and {BPE_MAX_VOCAB:,}.")
    hf = tk.Tokenizer(tk.models.BPE())
    hf.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
                                     special_tokens=[], show_progress=False)
    hf.train_from_iterator(texts, trainer)
    return Tokenizer("bpe", hf)


def parse_spec(spec: str) -> tuple[str, int | str | None]:
    """("bytes", None), ("bpe", VOCAB) or ("file", path) for a --tokenizer SPEC; ValueError naming it otherwise."""
    if spec == "bytes":
        return "bytes", None
    if spec.startswith("bpe:"):
        vocab = spec[4:].replace(",", "").replace("_", "")
        if not vocab.isdigit():
            raise ValueError(f"--tokenizer {spec!r}: VOCAB must be a whole number of ids, e.g. bpe:4096.")
        return "bpe", int(vocab)
    if os.path.isfile(spec):
        return "file", spec
    raise ValueError(f"--tokenizer {spec!r} is not bytes, bpe:VOCAB (e.g. bpe:4096) or the path of a tokenizer.json "
                     f"file.")


def read_metadata(directory) -> dict | None:
    """The meta.json of a prepared folder (a token file's path stands for its folder), or None where
    there is none; ValueError in one sentence for one that is not jdp's (see the module's docstring)."""
    directory = os.fspath(directory)
    if os.path.isfile(directory):
        directory = os.path.dirname(directory) or "."
    path = os.path.join(directory, META)
    if not os.path.lexists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{quoted(path)} cannot be read as JSON ({e}); prepare the folder again with jdp data "
                         f"prepare-tokens.") from None
    tok = meta.get("tokenizer") if isinstance(meta, dict) else None
    vocab = meta.get("vocab_size") if isinstance(meta, dict) else None
    if (not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1 or meta.get("dtype") not in META_DTYPES
            or not isinstance(tok, dict) or tok.get("kind") not in KINDS or not isinstance(meta.get("splits"), dict)):
        raise ValueError(f"{quoted(path)} is not the metadata jdp data prepare-tokens writes (vocab_size, dtype, "
                         f"tokenizer, splits); prepare the folder again.")
    return meta


def load_tokenizer(directory) -> Tokenizer:
    """The tokenizer of a prepared folder (its meta.json names it); a folder without meta.json holds byte tokens.
    ValueError if the tokenizer's vocabulary is not the size meta.json says."""
    directory = os.fspath(directory)
    if not os.path.exists(directory):
        raise ValueError(f"no such folder of prepared tokens: {quoted(directory)}.")
    meta = read_metadata(directory)
    if meta is None or meta["tokenizer"]["kind"] == "bytes":
        return Tokenizer("bytes")
    folder = os.path.dirname(directory) if os.path.isfile(directory) else directory
    tokenizer = Tokenizer.from_file(os.path.join(folder, meta["tokenizer"].get("file") or TOKENIZER_FILE),
                                    kind=meta["tokenizer"]["kind"])
    if tokenizer.vocab_size != meta["vocab_size"]:
        raise ValueError(f"the tokenizer in {quoted(folder)} has {tokenizer.vocab_size:,} ids but its meta.json says "
                         f"{meta['vocab_size']:,}; prepare the folder again.")
    return tokenizer


__all__ = ["KINDS", "META", "TOKENIZER_FILE", "Tokenizer", "dtype_for", "load_tokenizer", "parse_spec", "read_metadata",
           "train_bpe"]
