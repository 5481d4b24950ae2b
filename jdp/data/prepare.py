"""Token files from texts: what `jdp data prepare-tokens INPUT... OUTPUT` runs.

    jdp data prepare-tokens python-reference runs/pyref_tokens              # byte tokens, vocab 256
    jdp data prepare-tokens python-stdlib runs/stdlib_bpe --tokenizer bpe:4096
    jdp data prepare-tokens 'corpus/*.jsonl' runs/mine --field text --tokenizer my_model/tokenizer.json

writes into OUTPUT `train.bin` and `val.bin` in the format `jdp.data.load_tokens` reads (nanoGPT's):
token ids one after another, each a little-endian unsigned integer of `--dtype`, no header; the
tokenizer (`tokenizer.json`, except for bytes) and `meta.json`, which `jdp train` reads
(`jdp.data.tokenizer` says both). The dtype is uint16 up to 65,536 ids, uint32 above, unless
`--dtype` says uint32.

The INPUTs (`jdp.data.text_inputs`: files, globs, .jsonl records, the texts that ship with
Python) are read once, piece by piece, never whole: their bytes are hashed (meta.json's sha256)
and their text written to OUTPUT/text.partial in the same pass, so the digest is of the very
bytes encoded, whatever happens to a file afterwards. Everything after reads that copy: the BPE's
training (bpe:VOCAB, on the training split only) and the encoding, in chunks cut where a
GPT-2-style pre-tokenizer splits anyway, encoded on `workers` processes (`jdp.data.encoders`:
tiktoken where it gives the tokenizers library's ids, checked on the first chunk; else the
library), written in order as they come. The split is made on characters, as
`jdp.data.load_char_corpus` makes it: val.bin holds the last `val_fraction` of the characters
(rounded), train.bin the rest. With the bytes tokenizer the files are the text's UTF-8 bytes, as
before meta.json existed. text.partial is removed when the run ends; it needs as much disk as the
text.

Nothing in OUTPUT is overwritten and nothing outside it is written: each file is first written
as NAME.partial, created exclusively and never through a link (an existing NAME.partial, a
link included, is refused), then linked to its name, which fails if the name exists; a stopped
run removes its own .partial files. meta.json comes last: a folder with it is complete.
"""
from __future__ import annotations

import collections
import json
import os
import signal
import time

import numpy as np

from jdp.data.encoders import EncoderSpec, choose, encode_stream
from jdp.data.text_inputs import (READ_BYTES, REFERENCE, chunks, expand_inputs, split_pieces, spool,
                                  spooled_pieces)
from jdp.data.tokenizer import META, TOKENIZER_FILE, Tokenizer, dtype_for, parse_spec, train_bpe
from jdp.text import quoted

TOKEN_FILES = ("train.bin", "val.bin")
DTYPES = ("uint16", "uint32")
CHUNK_CHARS = 1 << 16  # characters per encoded chunk (cut at a pre-token boundary: `text_inputs.chunks`)
CHECK_CHARS = 1 << 13  # tiktoken is checked against the library on the text's first chunk of this size (up to 2x)
WORKER_CHARS = 1 << 24  # by default, a worker process for each 16 Mi characters of text, up to the cores
TASK_CHUNKS = 4  # chunks one worker encodes at a time (at most 2·workers tasks are in flight)
SPOOL = "text"  # OUTPUT/text.partial: the inputs' text as read once, removed when the run ends
TRAIN_CONFIG = "stdlib_bpe_gpt"  # the shipped config whose data.path names a prepared folder


def _quote_all(paths) -> str:
    names = [quoted(p) for p in paths]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


class _Files:
    """OUTPUT's files of one run: each written as NAME.partial (exclusive, no link followed), then
    linked to NAME; `discard()` removes what this run made and nothing else."""

    def __init__(self, out: str, names: list[str]):
        self.out, self.names, self.made, self.published = out, names, [], []
        self.created_out = False

    def check(self) -> None:
        """Refuse, naming them, files of this run's names already in OUTPUT."""
        paths = [os.path.join(self.out, n) for n in self.names]
        existing = [p for p in paths if os.path.lexists(p)]
        if existing:  # (a NAME.partial there is refused by `open`, which creates it exclusively)
            raise ValueError(f"{_quote_all(existing)} already exist{'s' if len(existing) == 1 else ''}; choose another "
                             f"OUTPUT folder or delete the token files there first.")
        if os.path.lexists(self.out) and not os.path.isdir(self.out):
            raise ValueError(f"OUTPUT {quoted(self.out)} exists and is not a folder; name a folder.")

    def open(self, name: str):
        """NAME.partial, created for writing (binary); refused if anything is there, a link included."""
        if not os.path.isdir(self.out):
            os.makedirs(self.out)
            self.created_out = True
        path = os.path.join(self.out, name + ".partial")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(path, flags, 0o644)
        except FileExistsError:
            raise ValueError(f"{quoted(path)} already exists (left by a prepare-tokens that was stopped, or one "
                             f"writing there now); delete it or choose another OUTPUT folder.") from None
        self.made.append(path)
        return os.fdopen(fd, "wb")

    def partial(self, name: str) -> str:
        """The path of this run's NAME.partial."""
        return os.path.join(self.out, name + ".partial")

    def drop(self, name: str) -> None:
        """Remove this run's NAME.partial (a scratch file, never published)."""
        os.unlink(self.partial(name))
        self.made.remove(self.partial(name))

    def publish(self) -> None:
        """Link each NAME.partial to NAME (which must not exist) and remove the .partial; meta.json last."""
        for name in sorted(self.names, key=lambda n: n == META):
            path = os.path.join(self.out, name)
            try:
                os.link(path + ".partial", path, follow_symlinks=False)
            except FileExistsError:
                raise ValueError(f"{quoted(path)} appeared while prepare-tokens wrote it; it is left as it is; choose "
                                 f"another OUTPUT folder.") from None
            self.published.append(path)
            os.unlink(path + ".partial")
            self.made.remove(path + ".partial")

    def discard(self) -> None:
        """Remove this run's .partial and published files (and OUTPUT if this run created it and it is empty)."""
        for path in self.made + self.published:
            try:
                os.unlink(path)
            except OSError:
                pass
        if self.created_out:
            try:
                os.rmdir(self.out)
            except OSError:
                pass


def _check_options(val_fraction: float, dtype: str | None) -> None:
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"--val-fraction {val_fraction} must be strictly between 0 and 1.")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not a token dtype for prepare-tokens; use one of {', '.join(DTYPES)}.")


def _split_sizes(inputs: list[str], total: int, val_fraction: float) -> int:
    """The training split's characters; ValueError for a text too short to give both splits text."""
    what = f"INPUT {_quote_all(inputs)}"
    if total == 0:
        raise ValueError(f"{what} hold{'s' if len(inputs) == 1 else ''} no text; there is nothing to tokenize.")
    n_train = int(round(total * (1.0 - val_fraction)))
    if n_train in (0, total):
        raise ValueError(f"{what} hold{'s' if len(inputs) == 1 else ''} {total} character{'s' * (total != 1)}, too "
                         f"few to hold out --val-fraction {val_fraction} and train on the rest; give more text.")
    return n_train


def _tasks(splits, chunk_chars: int, said: collections.deque):
    """Lists of at most TASK_CHUNKS chunks of each split's text in turn; for each, (split, characters,
    UTF-8 bytes) is appended to `said` as it is handed out."""
    for split, pieces in enumerate(splits):
        batch, nbytes, chars = [], 0, 0
        for chunk in chunks(pieces, chunk_chars):
            batch.append(chunk)
            nbytes += len(chunk.encode("utf-8"))
            chars += len(chunk)
            if len(batch) == TASK_CHUNKS:
                said.append((split, chars, nbytes))
                yield batch
                batch, nbytes, chars = [], 0, 0
        if batch:
            said.append((split, chars, nbytes))
            yield batch


def _encode(spec: EncoderSpec, splits, sinks, dtype: str, chunk_chars: int, workers: int, progress) -> dict:
    """Encode the texts `splits` (iterables of str, read in turn) into the open files `sinks`, one
    per split, on `workers` processes: {"train"|"val": {"tokens", "bytes", "characters"}}."""
    out_dtype = np.dtype(dtype).newbyteorder("<")
    said: collections.deque = collections.deque()
    counts = [{"tokens": 0, "bytes": 0, "characters": 0} for _ in sinks]
    for ids in encode_stream(spec, _tasks(splits, chunk_chars, said), workers, dtype):
        split, chars, nbytes = said.popleft()  # the results come in the order the tasks went out
        sinks[split].write(ids.astype(out_dtype, copy=False).tobytes())
        counts[split]["tokens"] += len(ids)
        counts[split]["bytes"] += nbytes
        counts[split]["characters"] += chars
        progress(chars, len(ids))
    return dict(zip((n[:-4] for n in TOKEN_FILES), counts))


class _Progress:
    """A rich bar over the characters encoded, with tokens/s, on a terminal only (stderr)."""

    def __init__(self, total: int, shown: bool):
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

        console = Console(stderr=True)
        self.bar = Progress(TextColumn("[bold]tokenize"), BarColumn(), TaskProgressColumn(),
                            TextColumn("{task.fields[rate]}"), TimeRemainingColumn(), console=console,
                            disable=not (shown and console.is_terminal), transient=True)
        self.task = self.bar.add_task("", total=total, rate="")
        self.start, self.tokens = time.perf_counter(), 0

    def __call__(self, chars: int, tokens: int) -> None:
        self.tokens += tokens
        rate = self.tokens / max(time.perf_counter() - self.start, 1e-9)
        self.bar.update(self.task, advance=chars, rate=f"{rate:,.0f} tokens/s")


def default_workers(chars: int | None = None) -> int:
    """The worker processes that encode `chars` characters by default: the CPU cores this process may
    run on (`os.sched_getaffinity`; the machine's count where there is none), but no more than one
    per WORKER_CHARS characters, since a process takes a fraction of a second to start."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return cores if chars is None else max(1, min(cores, -(-chars // WORKER_CHARS)))


def _check_workers(workers) -> None:
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise ValueError(f"--workers {workers!r} must be a whole number of processes, at least 1.")


def encoder_line(encoder: dict, workers: int) -> str:
    """The line prepare-tokens says (on stderr) about the encoder that runs, from meta.json's "encoder"."""
    library = "tiktoken" if encoder["engine"] == "tiktoken" else "the tokenizers library"
    return (f"encoding with {library} {encoder['version']} on {workers} worker process{'es' * (workers != 1)}: "
            f"{encoder['why']}")


def _encoder(tok: Tokenizer, first_chunk: str) -> tuple[EncoderSpec, dict]:
    """The encoder of `tok` and meta.json's record of it (`jdp.data.encoders.choose`)."""
    if tok.kind == "bytes":
        return EncoderSpec("bytes"), {"engine": "bytes", "version": None, "why": "one id per UTF-8 byte"}
    return choose(tok.to_json(), first_chunk)


def _tokenizer(kind: str, arg, train_text, n_train: int, chunk_chars: int, log) -> tuple[Tokenizer, float]:
    """The run's tokenizer (for kind bpe: trained on `train_text`, the n_train characters of the
    training split as pieces of str) and the seconds its training took."""
    if kind != "bpe":
        return (Tokenizer("bytes") if kind == "bytes" else Tokenizer.from_file(arg)), 0.0
    start = time.perf_counter()
    tok = train_bpe(chunks(train_text, chunk_chars), arg)
    seconds = time.perf_counter() - start
    if log:
        log(f"trained a byte-level BPE of {tok.vocab_size:,} ids on {n_train:,} characters in {seconds:.1f} s")
    return tok, seconds


def prepare(inputs, out: str, *, tokenizer: str = "bytes", val_fraction: float = 0.1, dtype: str | None = None,
            field: str = "text", workers: int | None = None, chunk_chars: int = CHUNK_CHARS,
            read_bytes: int = READ_BYTES, progress: bool = False, log=None, note=None) -> dict:
    """Tokenize the INPUTs (a str or a list) into the folder `out` (see the module's docstring) on
    `workers` processes (default: `default_workers`); returns the metadata written to
    out/meta.json, plus "seconds" {"read", "train_tokenizer", "encode"} and "workers" (not saved).

    `log(line)` is told what happens as it happens (the BPE's training), `note(line)` which encoder
    runs and why (`encoder_line`). Raises ValueError in one sentence for a bad option, input or
    tokenizer, an input too short to split, or a file of this run's names already in `out`;
    nothing in `out` is then left by this run.
    """
    given = [inputs] if isinstance(inputs, str) else list(inputs)
    paths = expand_inputs(given)
    _check_options(val_fraction, dtype)
    _check_workers(workers)
    kind, arg = parse_spec(tokenizer)
    names = [*TOKEN_FILES, *([TOKENIZER_FILE] if kind != "bytes" else []), META]
    files = _Files(out, names)
    files.check()
    handles = {}
    restore = _raise_on_ctrl_c()
    try:
        for name in [*names, SPOOL]:  # claimed before the long work
            handles[name] = files.open(name)
        meta, seconds, workers = _prepare_into(files, handles, paths, given, kind, arg, tokenizer, val_fraction,
                                               dtype, field, workers, chunk_chars, read_bytes, progress, log, note)
        files.publish()
    except BaseException:
        for h in handles.values():
            h.close()
        files.discard()
        raise
    finally:
        restore()
    return {**meta, "seconds": seconds, "workers": workers}


def _raise_on_ctrl_c():
    """Make Ctrl-C raise KeyboardInterrupt in this (main) thread, so that a stopped run removes its
    .partial files and ends its worker processes (jdp's command otherwise exits at once on it);
    returns the function that puts the handler back."""
    try:
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    except ValueError:  # not the main thread: signals are left alone
        return lambda: None
    return lambda: signal.signal(signal.SIGINT, previous)


def _prepare_into(files, handles, paths, given, kind, arg, spec, val_fraction, dtype, field, workers, chunk_chars,
                  read_bytes, progress, log, note) -> tuple[dict, dict, int]:
    """`prepare`'s work once its files are claimed: read the inputs once into the spool, split,
    tokenizer, encode, meta.json; returns (meta, seconds, the worker processes that encoded)."""
    start = time.perf_counter()
    with handles.pop(SPOOL) as f:
        total, digests = spool(paths, f, field=field, read_bytes=read_bytes)
    seconds = {"read": time.perf_counter() - start}
    n_train = _split_sizes(given, total, val_fraction)
    workers = workers or default_workers(total)
    text = lambda: spooled_pieces(files.partial(SPOOL), read_bytes)  # noqa: E731
    tok, seconds["train_tokenizer"] = _tokenizer(kind, arg, split_pieces(text(), n_train)[0], n_train,
                                               chunk_chars, log)
    if dtype == "uint16" and tok.vocab_size > 1 << 16:
        raise ValueError(f"--dtype uint16 holds at most 65,536 ids, and the tokenizer has {tok.vocab_size:,}; "
                         f"use --dtype uint32 (or leave --dtype out).")
    dtype = dtype or dtype_for(tok.vocab_size)
    encoder_spec, encoder = _encoder(tok, next(chunks(text(), CHECK_CHARS)))
    if note and kind != "bytes":
        note(encoder_line(encoder, workers))
    bar, start = _Progress(total, progress), time.perf_counter()
    with bar.bar, handles.pop(TOKEN_FILES[0]) as train, handles.pop(TOKEN_FILES[1]) as val:
        splits = _encode(encoder_spec, split_pieces(text(), n_train), (train, val), dtype, chunk_chars, workers, bar)
    seconds["encode"] = time.perf_counter() - start
    files.drop(SPOOL)
    if kind != "bytes":
        with handles.pop(TOKENIZER_FILE) as f:
            f.write(tok.to_json().encode("utf-8"))
    meta = {"vocab_size": tok.vocab_size, "dtype": dtype,
            "tokenizer": {"kind": kind, "file": None if kind == "bytes" else TOKENIZER_FILE, "spec": spec},
            "encoder": encoder, "splits": splits, "inputs": digests, "val_fraction": val_fraction, "field": field}
    with handles.pop(META) as f:
        f.write((json.dumps(meta, indent=1) + "\n").encode("utf-8"))
    return meta, seconds, workers


def summary(meta: dict, out: str) -> list[str]:
    """The lines prepare-tokens prints: the files, the throughput, and the command that trains on them."""
    (nt, ct), (nv, cv) = ((meta["splits"][s]["tokens"], meta["splits"][s]["characters"]) for s in ("train", "val"))
    total, seconds = nt + nv, meta["seconds"]["encode"]
    return [f"train.bin: {nt:,} tokens ({ct:,} characters); val.bin: {nv:,} tokens ({cv:,} characters); "
            f"vocab_size {meta['vocab_size']:,}, dtype {meta['dtype']} -> {out}",
            f"wrote {total:,} tokens (vocab {meta['vocab_size']:,}, {meta['dtype']}) in {seconds:.1f} s, "
            f"{total / max(seconds, 1e-9):,.0f} tokens/s",
            f"train on it: jdp train {TRAIN_CONFIG} --set data.path={out}"]


def prepare_from(source, out: str, *, val_fraction: float = 0.1, dtype: str | None = None, tokenizer: str = "bytes",
                 field: str = "text", workers: int | None = None, progress: bool = False, log=None, note=None) -> str:
    """`prepare` on the INPUT(s) `source`; returns the lines that say what was written (`summary`).
    ValueError, in one sentence, for bad input or a file that cannot be read or written."""
    try:
        meta = prepare(source, out, tokenizer=tokenizer, val_fraction=val_fraction, dtype=dtype, field=field,
                       workers=workers, progress=progress, log=log, note=note)
    except OSError as e:  # an unreadable INPUT, an OUTPUT that cannot be created or written, a full disk
        raise ValueError(f"cannot prepare {out!r} from {source!r}: {e.strerror or e}"
                         + (f" ({e.filename!r})." if e.filename else ".")) from None
    return "\n".join(summary(meta, out))


__all__ = ["CHECK_CHARS", "CHUNK_CHARS", "DTYPES", "REFERENCE", "SPOOL", "TASK_CHUNKS", "TOKEN_FILES", "TRAIN_CONFIG",
           "WORKER_CHARS", "default_workers", "encoder_line", "prepare", "prepare_from", "summary"]
