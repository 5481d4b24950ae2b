"""Tokenizer throughput: `jdp data prepare-tokens` against nanoGPT's prepare.py approach on the same text.

    python -m benchmarks.tokenize                  # python-stdlib (4.7 MB), bpe:4096, 3 rounds
    python -m benchmarks.tokenize --vocab 8192 --rounds 5 --out /tmp/tokenize.md

The text: the standard library's top-level .py files (`python-stdlib`, jdp.data.text_inputs).
Contenders, timed in alternating rounds in one process, each writing its token files:

- jdp, bytes: `prepare(..., tokenizer="bytes")` (one token per UTF-8 byte).
- jdp, bpe:VOCAB: `prepare(..., tokenizer="bpe:VOCAB")`: trains the byte-level BPE on the training
  split, then encodes; the training and the encoding are reported apart.
- jdp, tokenizer.json: `prepare(..., tokenizer=PATH)` with that BPE saved: encoding only.
- nanoGPT's approach (data/openwebtext/prepare.py, data/shakespeare/prepare.py): tiktoken's
  `Encoding.encode_ordinary_batch` over the documents (here: the files, read whole), then one
  uint16 array per split written with `tofile`. nanoGPT uses tiktoken's GPT-2 encoding, which tiktoken downloads; with no
  network here, the Encoding is built from the same trained BPE (its merges as tiktoken ranks,
  GPT-2's pre-tokenizer regex), so both encode the same vocabulary, and the ids are compared.

tokens/s are the tokens written over the seconds of each contender's encoding (reading the text,
encoding, writing), median of the rounds; jdp's include its chunking, counting and meta.json.
Both libraries use all the CPU cores (Rust threads); the machine's load is reported.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import numpy as np

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def byte_unicode() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character each byte is written as in a byte-level BPE's vocabulary, inverted."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def tiktoken_encoding(tokenizer_json: str):
    """A tiktoken Encoding with the byte-level BPE's merges (ranks = its ids) and GPT-2's pattern."""
    import tiktoken
    from tokenizers import Tokenizer

    to_byte = byte_unicode()
    vocab = Tokenizer.from_file(tokenizer_json).get_vocab()
    ranks = {bytes(to_byte[c] for c in token): i for token, i in vocab.items()}
    return tiktoken.Encoding("jdp_bpe", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={})


def nanogpt_prepare(enc, paths: list[str], val_fraction: float, out: str) -> tuple[int, float]:
    """nanoGPT's approach: the documents (the files; the one holding the split point cut there, the
    split made on characters as jdp makes it) through `encode_ordinary_batch`, then `tofile`."""
    start = time.perf_counter()
    docs = [open(p, encoding="utf-8").read() for p in paths]
    n, at, split = int(round(sum(map(len, docs)) * (1 - val_fraction))), 0, ([], [])
    for doc in docs:
        cut = min(max(n - at, 0), len(doc))
        split[0].append(doc[:cut])
        split[1].append(doc[cut:])
        at += len(doc)
    total = 0
    for name, part in zip(("train.bin", "val.bin"), split):
        batch = enc.encode_ordinary_batch([d for d in part if d], num_threads=os.cpu_count())
        ids = np.concatenate([np.asarray(i, np.uint16) for i in batch])
        ids.tofile(os.path.join(out, name))
        total += len(ids)
    return total, time.perf_counter() - start


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=os.path.join("benchmarks", "results", "tokenize.md"))
    a = ap.parse_args(argv)

    from jdp.data.prepare import prepare
    from jdp.data.text_inputs import STDLIB, stdlib_files

    paths = stdlib_files()
    size = sum(os.path.getsize(p) for p in paths)
    times: dict[str, list[float]] = {}
    tokens: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="jdp-tokenize-") as tmp:
        def run_jdp(name, spec, seconds_key="encode"):
            out = os.path.join(tmp, name.replace(" ", "_").replace(":", "_").replace(".", "_"))
            shutil.rmtree(out, ignore_errors=True)
            meta = prepare(STDLIB, out, tokenizer=spec)
            tokens[name] = sum(s["tokens"] for s in meta["splits"].values())
            times.setdefault(name, []).append(meta["seconds"][seconds_key])
            if spec.startswith("bpe:"):
                times.setdefault(f"{name} (training)", []).append(meta["seconds"]["train_tokenizer"])
            return out

        bpe = run_jdp(f"jdp bpe:{a.vocab}", f"bpe:{a.vocab}")
        saved = os.path.join(tmp, "tokenizer.json")
        shutil.copy(os.path.join(bpe, "tokenizer.json"), saved)
        enc = tiktoken_encoding(saved)
        for r in range(a.rounds):
            if r:
                run_jdp(f"jdp bpe:{a.vocab}", f"bpe:{a.vocab}")
            run_jdp("jdp tokenizer.json", saved)
            ref = os.path.join(tmp, "nanogpt")
            os.makedirs(ref, exist_ok=True)
            n, s = nanogpt_prepare(enc, paths, 0.1, ref)
            tokens["nanoGPT's approach (tiktoken)"] = n
            times.setdefault("nanoGPT's approach (tiktoken)", []).append(s)
            run_jdp("jdp bytes", "bytes")
        same = [np.array_equal(np.fromfile(os.path.join(bpe, f), "<u2"), np.fromfile(os.path.join(ref, f), "<u2"))
                for f in ("train.bin", "val.bin")]
    load = os.getloadavg()[0]
    rows = ["| contender | tokens | seconds (median) | tokens/s |", "|---|---|---|---|"]
    for name, ts in times.items():
        t = statistics.median(ts)
        if name.endswith("(training)"):
            rows.append(f"| {name} | | {t:.2f} | |")
        else:
            rows.append(f"| {name} | {tokens[name]:,} | {t:.2f} | {tokens[name] / t:,.0f} |")
    report = (f"# Tokenizer throughput\n\n`python -m benchmarks.tokenize --vocab {a.vocab} --rounds {a.rounds}`: "
              f"the standard library's {len(paths)} top-level .py files ({size / 1e6:.1f} MB), {os.cpu_count()} CPU "
              f"cores, load average {load:.1f}.\n\n" + "\n".join(rows)
              + f"\n\ntiktoken's ids equal jdp's (the same BPE): train.bin {same[0]}, val.bin {same[1]}.\n")
    print(report)
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w", encoding="utf-8") as f:
        f.write(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
