"""How `jdp data prepare-tokens` turns chunks of text into ids, and on how many processes.

An encoder is an `EncoderSpec`: its engine and the tokenizer.json text (picklable, so worker
processes build their own). The engines:

- "bytes": one id per UTF-8 byte (numpy).
- "tiktoken": a tiktoken `Encoding` built from a GPT-2-style byte-level BPE (a tokenizer.json whose
  model is a BPE over GPT-2's byte alphabet, pre-tokenized by GPT-2's pattern, no normalizer): the
  vocabulary's byte strings ranked by their ids, the added tokens as special tokens. tiktoken
  merges in rank order where the library merges in the order of its merges list; the two agree
  for a BPE whose merges made its ids in order (one trained by the library, GPT-2's), and `choose`
  checks it on the text's first chunk before using it.
- "tokenizers": Hugging Face's library itself, which reads any tokenizer.json.

`choose` picks tiktoken where it is installed, can express the tokenizer and gives the library's
ids on the sample, else the library, and says why. `encode_stream` runs the encoder in this process
(1 worker) or in `workers` spawned processes, keeping at most 2·workers tasks in flight, so memory
does not grow with the input, and yielding the ids in the order of the tasks.
"""
from __future__ import annotations

import collections
import functools
import importlib.metadata
import json
import multiprocessing
import signal
from dataclasses import dataclass

import numpy as np

ENGINES = ("bytes", "tiktoken", "tokenizers")
# GPT-2's pre-tokenizer: the pattern of the byte-level pre-tokenizer (use_regex=true) and of tiktoken's gpt2
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


@dataclass(frozen=True)
class EncoderSpec:
    """An encoder a worker process can rebuild: `engine` (one of ENGINES) and the tokenizer.json text
    (None for bytes)."""
    engine: str
    tokenizer_json: str | None = None


def byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character each byte is written as in the vocabulary -> the byte."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _byte_level(pre: dict | None) -> bool:
    """Whether a pre_tokenizer is GPT-2's: ByteLevel with its regex and no prefix space."""
    return (isinstance(pre, dict) and pre.get("type") == "ByteLevel" and pre.get("use_regex", True)
            and not pre.get("add_prefix_space", False))


def tiktoken_unfit(config: dict) -> str | None:
    """Why tiktoken cannot express the tokenizer.json `config` (parsed), in a phrase; None where it can."""
    model = config.get("model") or {}
    if model.get("type") != "BPE":
        return f"its model is {model.get('type')!r}, not a BPE"
    if not _byte_level(config.get("pre_tokenizer")):
        pre = config.get("pre_tokenizer")
        return f"its pre-tokenizer ({pre.get('type') if isinstance(pre, dict) else pre}) is not GPT-2's byte-level one"
    if config.get("normalizer") is not None:
        return "it has a normalizer"
    if model.get("dropout") or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix") \
            or model.get("byte_fallback"):
        return "its BPE has dropout, a subword prefix or suffix, or byte fallback"
    alphabet = byte_alphabet()
    if not all(c in model["vocab"] for c in alphabet):
        return "its vocabulary lacks some of the 256 byte tokens"
    if any(c not in alphabet for token in model["vocab"] for c in token):
        return "its vocabulary holds tokens outside the byte alphabet"
    if any(a.get("lstrip") or a.get("rstrip") or a.get("single_word") for a in config.get("added_tokens", [])):
        return "an added token strips spaces or matches whole words only"
    return None


def tiktoken_encoding(config: dict):
    """The tiktoken Encoding of a tokenizer.json `config` that `tiktoken_unfit` accepts."""
    import tiktoken

    alphabet = byte_alphabet()
    special = {a["content"]: a["id"] for a in config.get("added_tokens", [])}
    taken = set(special.values())  # an added token's id is matched as a special token, never merged to
    ranks = {bytes(alphabet[c] for c in token): i for token, i in config["model"]["vocab"].items() if i not in taken}
    return tiktoken.Encoding("jdp_bpe", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens=special)


@functools.lru_cache(maxsize=2)  # `choose` builds the encoder that then runs in this process
def build(spec: EncoderSpec):
    """The function `texts -> ids` of `spec`: a list of str -> (total,) int64 ids, one text after
    another, encoded on this thread alone, no special tokens added."""
    if spec.engine == "bytes":
        return lambda texts: np.frombuffer("".join(texts).encode("utf-8"), np.uint8).astype(np.int64)
    if spec.engine == "tiktoken":
        enc = tiktoken_encoding(json.loads(spec.tokenizer_json))
        special = bool(enc.special_tokens_set)  # added tokens in the text: matched, as by the library
        # (encode_ordinary, then np.asarray, takes 2/3 of the CPU time of encode_to_numpy, measured)
        one = (lambda t: enc.encode(t, allowed_special="all")) if special else enc.encode_ordinary
    else:
        import tokenizers

        hf = tokenizers.Tokenizer.from_str(spec.tokenizer_json)
        one = lambda t: hf.encode(t, add_special_tokens=False).ids  # noqa: E731
    return lambda texts: np.concatenate([np.zeros(0, np.int64), *(np.asarray(one(t), np.int64) for t in texts)])


def _version(module: str) -> str | None:
    try:
        return importlib.metadata.version(module)
    except importlib.metadata.PackageNotFoundError:
        return None


def choose(tokenizer_json: str, sample: str) -> tuple[EncoderSpec, dict]:
    """The engine for a tokenizer.json: tiktoken where it is installed, can express the tokenizer
    and encodes `sample` (the text's first chunk) to the library's ids; else the library.
    Returns (spec, {"engine", "version", "why"}), "why" a phrase saying why that engine runs."""
    config = json.loads(tokenizer_json)
    library = EncoderSpec("tokenizers", tokenizer_json)

    def fallback(why: str):
        return library, {"engine": "tokenizers", "version": _version("tokenizers"), "why": why}

    unfit = tiktoken_unfit(config)
    if unfit:
        return fallback(f"tiktoken cannot reproduce this tokenizer: {unfit}")
    try:
        import tiktoken  # noqa: F401
    except ImportError:
        from jdp.extras import install_command

        return fallback(f"tiktoken is not installed (install it with {install_command('tokenizers')})")
    fast = EncoderSpec("tiktoken", tokenizer_json)
    theirs, ours = build(library)([sample]), build(fast)([sample])
    if not np.array_equal(theirs, ours):
        n = min(len(theirs), len(ours))
        at = int(np.argmax(theirs[:n] != ours[:n])) if (theirs[:n] != ours[:n]).any() else n
        return fallback(f"tiktoken's ids differ from the tokenizers library's on the first {len(sample):,} characters "
                        f"(from token {at:,} on)")
    return fast, {"engine": "tiktoken", "version": _version("tiktoken"),
                  "why": f"its ids equal the tokenizers library's on the first {len(sample):,} characters"}


_worker_encode = None  # the encoder of a worker process, built once by `_start_worker`


def _start_worker(spec: EncoderSpec) -> None:
    global _worker_encode
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle (it ends the pool)
    _worker_encode = build(spec)


def _encode_task(texts: list[str], dtype: str) -> np.ndarray:
    return _worker_encode(texts).astype(dtype)


def encode_stream(spec: EncoderSpec, tasks, workers: int, dtype: str):
    """The ids of each task (an iterable of lists of str), in order, each a (n,) array of `dtype`:
    encoded here (workers 1, or the bytes engine) or in `workers` spawned processes, at most
    2·workers tasks in flight."""
    if workers <= 1 or spec.engine == "bytes":
        encode = build(spec)
        for texts in tasks:
            yield encode(texts).astype(dtype)
        return
    with multiprocessing.get_context("spawn").Pool(workers, _start_worker, (spec,)) as pool:
        pending = collections.deque()
        for texts in tasks:
            pending.append(pool.apply_async(_encode_task, (texts, dtype)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
        pool.close()
        pool.join()


__all__ = ["ENGINES", "EncoderSpec", "GPT2_PATTERN", "build", "byte_alphabet", "choose", "encode_stream",
           "tiktoken_encoding", "tiktoken_unfit"]
