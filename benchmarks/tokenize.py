"""Tokenizer throughput and memory: `jdp data prepare-tokens` against tiktoken and the tokenizers library
on the same BPE and text, and its peak memory against the input's size.

    python -m benchmarks.tokenize                          # python-stdlib (4.7 MB), bpe:4096, 3 rounds; 0.1-0.8 GB, 1 and 2 workers
    python -m benchmarks.tokenize --sizes 0.5,1,2,4        # memory at these sizes in GB (check df -h /tmp first)
    python -m benchmarks.tokenize --sizes '' --rounds 5    # throughput only

Throughput. The text: the standard library's top-level .py files (`python-stdlib`). jdp trains a
byte-level BPE on it (`bpe:VOCAB`, timed once); that tokenizer.json is then encoded by the
contenders, timed in alternating rounds in one process:

- jdp, tokenizer.json, 1 / 2 workers: `prepare(..., tokenizer=PATH, workers=N)`, the whole call
  (reading the files once into OUTPUT/text.partial, checking tiktoken against the library on the
  first chunk, encoding with tiktoken, writing the files and meta.json) and its encoding alone.
- tiktoken alone, one core: the `Encoding` jdp builds from the same tokenizer.json,
  `encode_ordinary` on each split's text held in memory.
- the tokenizers library alone, one core: `Tokenizer.encode` on each split's text in memory.
- nanoGPT's approach (data/openwebtext/prepare.py): tiktoken's `encode_ordinary_batch` over the
  documents (the files, read whole; the one holding the split point cut there) on all cores, then
  `tofile`. nanoGPT's GPT-2 encoding is downloaded; here the same BPE stands in for it.
- jdp, bytes (one token per UTF-8 byte), 1 worker.

Every contender's ids are compared with jdp's, token for token. tokens/s = tokens / seconds, the
median of the rounds; the machine's load average is reported.

Memory. For each size, a text of that many bytes (the standard library's files repeated) is
written to a temporary folder in /tmp, `jdp data prepare-tokens` encodes it with that BPE in a
fresh process (on each of `--memory-workers`, 1 and 2 by default), which samples its own and its workers' resident
memory every 50 ms (/proc/PID/status) and reports the peak of their sum; then the folder is
deleted. Peak memory that stays flat as the input grows is what "streams" means.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np


def split_texts(paths: list[str], val_fraction: float) -> tuple[str, str]:
    """The inputs' text (as prepare-tokens reads it) cut at jdp's split character: (train, val)."""
    text = "".join(open(p, encoding="utf-8").read() for p in paths)
    n = int(round(len(text) * (1 - val_fraction)))
    return text[:n], text[n:]


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


def timed(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start


def throughput(a, tmp: str) -> tuple[list[str], dict]:
    """The throughput table's rows and whether each contender's ids equal jdp's."""
    import tiktoken  # noqa: F401  (the bench extra)
    import tokenizers

    from jdp.data.encoders import tiktoken_encoding
    from jdp.data.prepare import prepare
    from jdp.data.text_inputs import STDLIB, stdlib_files

    paths = stdlib_files()
    bpe = os.path.join(tmp, "bpe")
    meta = prepare(STDLIB, bpe, tokenizer=f"bpe:{a.vocab}", workers=1)
    tok_json = os.path.join(bpe, "tokenizer.json")
    enc = tiktoken_encoding(json.loads(open(tok_json, encoding="utf-8").read()))
    hf = tokenizers.Tokenizer.from_file(tok_json)
    texts = split_texts(paths, 0.1)
    want = [np.fromfile(os.path.join(bpe, f), "<u2").tolist() for f in ("train.bin", "val.bin")]
    times: dict[str, list[float]] = {f"jdp bpe:{a.vocab}: training the BPE": [meta["seconds"]["train_tokenizer"]]}
    tokens, same = {}, {}

    def record(name, ids_or_n, seconds):
        n = ids_or_n if isinstance(ids_or_n, int) else sum(map(len, ids_or_n))
        tokens[name] = n
        times.setdefault(name, []).append(seconds)
        if not isinstance(ids_or_n, int):
            same[name] = same.get(name, True) and [list(i) for i in ids_or_n] == want

    for r in range(a.rounds):
        for workers in (1, 2):
            out = os.path.join(tmp, f"jdp{workers}_{r}")
            m, s = timed(lambda: prepare(STDLIB, out, tokenizer=tok_json, workers=workers))
            got = [np.fromfile(os.path.join(out, f), "<u2").tolist() for f in ("train.bin", "val.bin")]
            record(f"jdp, tokenizer.json ({m['encoder']['engine']}), {workers} worker{'s' * (workers > 1)}: "
                   f"the whole command", got, s)
            record(f"jdp, tokenizer.json, {workers} worker{'s' * (workers > 1)}: encoding alone", got,
                   m["seconds"]["encode"])
            shutil.rmtree(out)
        ids, s = timed(lambda: [enc.encode_ordinary(t) for t in texts])
        record("tiktoken alone, one core, the same BPE", ids, s)
        ids, s = timed(lambda: [hf.encode(t, add_special_tokens=False).ids for t in texts])
        record("the tokenizers library alone, one core, the same BPE", ids, s)
        ref = os.path.join(tmp, "nanogpt")
        os.makedirs(ref, exist_ok=True)
        n, s = nanogpt_prepare(enc, paths, 0.1, ref)
        record(f"nanoGPT's approach (tiktoken's encode_ordinary_batch, {os.cpu_count()} threads)",
               [np.fromfile(os.path.join(ref, f), "<u2").tolist() for f in ("train.bin", "val.bin")], s)
        out = os.path.join(tmp, f"bytes_{r}")
        m, s = timed(lambda: prepare(STDLIB, out, workers=1))
        record("jdp, bytes, 1 worker: the whole command", sum(x["tokens"] for x in m["splits"].values()), s)
        shutil.rmtree(out)
    rows = ["| contender | tokens | seconds (median) | tokens/s | ids equal jdp's 1-worker bpe run |",
            "|---|---|---|---|---|"]
    for name, ts in times.items():
        t = statistics.median(ts)
        if name not in tokens:
            rows.append(f"| {name} | | {t:.2f} | | |")
        else:
            rows.append(f"| {name} | {tokens[name]:,} | {t:.2f} | {tokens[name] / t:,.0f} | "
                        f"{same.get(name, '—')} |")
    size = sum(os.path.getsize(p) for p in paths)
    head = (f"`python -m benchmarks.tokenize --vocab {a.vocab} --rounds {a.rounds}`: the standard library's "
            f"{len(paths)} top-level .py files ({size / 1e6:.1f} MB)")
    return [head, ""] + rows, {"tokenizer": tok_json}


def _status_kib(pid: int | str, keys=("VmRSS", "RssAnon", "VmHWM")) -> dict[str, int]:
    """Fields of /proc/PID/status in KiB (missing ones 0: a process that has just ended)."""
    out = dict.fromkeys(keys, 0)
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in out:
                    out[key] = int(value.split()[0])
    except OSError:
        pass
    return out


def _children() -> list[str]:
    pids = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                pids += f.read().split()
        except OSError:
            pass
    return pids


def measure(argv: list[str]) -> int:
    """(in a fresh process) `jdp data prepare-tokens ARGV` while a thread samples, every 50 ms, the
    resident memory of this process and of its workers; prints, as JSON in bytes, the peak of their
    sum (VmRSS: all resident pages; RssAnon: the anonymous ones, without the shared libraries' file
    pages) and this process's own high-water mark (VmHWM, which starts afresh at exec, unlike
    ru_maxrss)."""
    import threading

    from jdp.run.cli import main as jdp

    peak, done = {"VmRSS": 0, "RssAnon": 0, "workers": 0}, threading.Event()

    def sample():
        while not done.wait(0.05):
            parts = [_status_kib("self")] + [_status_kib(p) for p in _children()]
            for key in ("VmRSS", "RssAnon"):
                peak[key] = max(peak[key], sum(p[key] for p in parts))
            peak["workers"] = max(peak["workers"], len(parts) - 1)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    start = time.perf_counter()
    rc = jdp(["data", "prepare-tokens", *argv, "--no-progress"])
    seconds = time.perf_counter() - start
    done.set()
    thread.join()
    kib = 1024
    print(json.dumps({"rc": rc, "seconds": seconds, "rss": peak["VmRSS"] * kib, "anon": peak["RssAnon"] * kib,
                      "hwm": _status_kib("self")["VmHWM"] * kib, "children_seen": peak["workers"]}))
    return rc


def write_text(path: str, size: int, sources: list[str]) -> None:
    """`size` bytes of text: the source files one after another, again and again, cut at a line end."""
    blob = b"".join(open(p, "rb").read() for p in sources)
    with open(path, "wb") as f:
        left = size
        while left > 0:
            part = blob[:left]
            if len(part) < len(blob):
                part = part[:part.rfind(b"\n") + 1] or part
            f.write(part)
            left -= len(part)
            if len(part) < len(blob):
                break


def memory(a, tokenizer: str) -> list[str]:
    """The memory table: for each size, peak RSS of prepare-tokens (main process, largest worker)."""
    from jdp.data.text_inputs import stdlib_files

    rows = ["| input | workers | tokens | seconds | tokens/s | peak RSS, all processes | peak anonymous RSS, all "
            "processes | main process's high-water mark |", "|---|---|---|---|---|---|---|---|"]
    for gb in [float(x) for x in a.sizes.split(",") if x]:
        with tempfile.TemporaryDirectory(prefix="jdp-tokenize-mem-", dir="/tmp") as tmp:
            text = os.path.join(tmp, "corpus.txt")
            write_text(text, int(gb * 1e9), stdlib_files())
            for workers in [int(w) for w in a.memory_workers.split(",")]:
                out = os.path.join(tmp, f"out{workers}")
                r = subprocess.run([sys.executable, "-m", "benchmarks.tokenize", "--measure", text, out, "--tokenizer",
                                    tokenizer, "--workers", str(workers)], capture_output=True, text=True)
                if r.returncode:
                    raise SystemExit(f"prepare-tokens on {gb} GB failed: {r.stderr.strip()}")
                m = json.loads(r.stdout.strip().splitlines()[-1])
                meta = json.load(open(os.path.join(out, "meta.json")))
                shutil.rmtree(out)
                n = sum(s["tokens"] for s in meta["splits"].values())
                rows.append(f"| {os.path.getsize(text) / 1e9:.2f} GB | {workers} | {n:,} | {m['seconds']:.0f} | "
                            f"{n / m['seconds']:,.0f} | {m['rss'] / 2**20:,.0f} MiB | {m['anon'] / 2**20:,.0f} MiB | "
                            f"{m['hwm'] / 2**20:,.0f} MiB |")
                print(rows[-1], flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sizes", default="0.1,0.2,0.4,0.8", help="input sizes in GB for the memory table ('' : none)")
    ap.add_argument("--memory-workers", default="1,2", help="worker processes for the memory table, e.g. 1,2")
    ap.add_argument("--measure", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=os.path.join("benchmarks", "results", "tokenize.md"))
    a = ap.parse_args(argv)
    if a.measure is not None:
        return measure(a.measure)
    with tempfile.TemporaryDirectory(prefix="jdp-tokenize-") as tmp:
        rows, got = throughput(a, tmp)
        print("\n".join(rows), flush=True)
        mem = memory(a, got["tokenizer"]) if a.sizes else []
    load = os.getloadavg()
    report = (f"# Tokenizer throughput and memory\n\n{rows[0]}, {os.cpu_count()} CPU cores, load average "
              f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1 / 5 / 15 min) at the end, "
              f"{time.strftime('%Y-%m-%d', time.gmtime())}.\n\n" + "\n".join(rows[2:]) + "\n")
    if mem:
        report += ("\nPeak resident memory of `jdp data prepare-tokens FILE OUT --tokenizer tokenizer.json` against "
                   f"the input's size (`--sizes {a.sizes} --memory-workers {a.memory_workers}`, the standard library's "
                   "text repeated):\n\n"
                   + "\n".join(mem) + "\n")
    print(report)
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w", encoding="utf-8") as f:
        f.write(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
