"""`jdp configs`, `jdp data prepare-tokens`, `jdp sample`, `jdp export`: what ships with jdp, for `jdp train`, and a run's
use after it (jdp.run.cli adds them).

Their parsers import nothing heavy, so `jdp --help` stays instant; the commands import their
modules when they run.
"""
from __future__ import annotations

import argparse
import sys


def add_configs_parser(sub) -> None:
    sub.add_parser("configs", help="list the shipped configs, each with the result it should reach",
                   description="List the configs that ship with jdp (jdp train NAME trains one): what each trains, "
                   "the command that runs it and the result it reached when it was measured.")


def add_data_parser(sub) -> None:
    """`jdp data prepare-tokens` (jdp.data.prepare, imported only when it runs: --help stays instant)."""
    data = sub.add_parser("data", help="prepare data files for jdp train", description="Tools for jdp's data files.")
    what = data.add_subparsers(dest="data_command", required=True, metavar="SUBCOMMAND", help="what to prepare")
    tokens = what.add_parser(
        "prepare-tokens", help="token files (train.bin, val.bin), the tokenizer and meta.json from texts",
        description="Write OUTPUT/train.bin and OUTPUT/val.bin, the format data.name tokens reads (nanoGPT's: "
        "token ids, each a little-endian unsigned integer of --dtype, no header), the tokenizer (tokenizer.json) "
        "and meta.json (vocab size, dtype, tokenizer, the inputs' sha256), which jdp train reads. Each INPUT is "
        "read once, piece by piece, never whole, into OUTPUT/text.partial (removed at the end), whose text is "
        "encoded; val.bin holds the last --val-fraction of the characters. A GPT-2-style byte-level BPE is encoded "
        "with tiktoken where it gives the tokenizers library's ids. Nothing in OUTPUT is ever overwritten.")
    tokens.add_argument("input", nargs="+", metavar="INPUT", help="UTF-8 text files, .jsonl files (their --field), "
                        "glob patterns ('corpus/*.txt'), python-reference (the Python Language Reference text) or "
                        "python-stdlib (the standard library's .py files): read one after another")
    tokens.add_argument("output", metavar="OUTPUT", help="the folder to write the token files, tokenizer and meta.json into")
    tokens.add_argument("--tokenizer", default="bytes", metavar="SPEC", help="bytes (one token per UTF-8 byte, 256 ids; "
                        "the default), bpe:VOCAB (a byte-level BPE of VOCAB ids trained here on the training text) or "
                        "the path of a tokenizer.json; the last two need the tokenizers extra")
    tokens.add_argument("--dtype", default=None, help="the token files' integer type: uint16 (the default up to 65,536 "
                        "ids) or uint32 (the default above)")
    tokens.add_argument("--val-fraction", type=float, default=0.1, help="the held-out share of characters (0.1)")
    tokens.add_argument("--field", default="text", help="the field of each .jsonl record that holds its text (text)")
    tokens.add_argument("--workers", type=_number(1, None, "at least 1", integer=True), metavar="N",
                        help="processes that encode (default: the CPU cores this process may use, but no more than "
                        "one per 16 Mi characters of text); the ids are the same for any N")
    tokens.add_argument("--no-progress", action="store_true", help="no progress bar (it shows on a terminal only)")


def _number(low: float, high: float | None, what: str, *, integer: bool = False, closed_low: bool = True):
    """An argparse type: a number in [low, high] (low excluded unless `closed_low`), said in one sentence."""
    def parse(text: str):
        try:
            value = int(text) if integer else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if integer else 'a number'}") from None
        if not (value >= low if closed_low else value > low) or (high is not None and value > high) or value != value:
            raise argparse.ArgumentTypeError(f"{text} must be {what}")
        return value
    return parse


def add_sample_parser(sub) -> None:
    """`jdp sample WORKDIR` (jdp.run.sampling, imported only when it runs)."""
    sample = sub.add_parser(
        "sample", help="continue text with a trained GPT run",
        description="Read WORKDIR's newest intact checkpoint (trained replicated, with ZeRO-1 or FSDP, scanned or "
        "not) and print each prompt's continuation, decoded with the run's own tokenizer; the prompts run as one "
        "batch, with a key/value cache and a compiled decode loop. Nothing in WORKDIR is written.")
    sample.add_argument("workdir", metavar="WORKDIR", help="the run directory (jdp train's --workdir)")
    sample.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                        help="a prompt (repeatable: one row of the batch each; default: a newline)")
    sample.add_argument("--prompts-file", metavar="FILE", help="a UTF-8 text file of prompts, one per line")
    sample.add_argument("--tokens", type=_number(1, None, "at least 1", integer=True), metavar="N",
                        help="new tokens per prompt (default: as many as the context leaves after the longest prompt)")
    sample.add_argument("--temperature", type=_number(0.0, None, "0 (greedy) or positive"), default=1.0, metavar="T",
                        help="softmax temperature; 0: greedy, the most likely token each time (default 1.0)")
    sample.add_argument("--top-k", type=_number(1, None, "at least 1", integer=True), metavar="K",
                        help="draw only from the K most likely tokens (default: all)")
    sample.add_argument("--top-p", type=_number(0.0, 1.0, "in (0, 1]", closed_low=False), metavar="P",
                        help="draw only from the most likely tokens whose probabilities add up to P (default: all)")
    sample.add_argument("--seed", type=int, default=0, help="the sampling key's seed: the same seed, the same text (0)")


def _prompts(args) -> list[str]:
    """--prompt texts, then the lines of --prompts-file; a newline when neither is given."""
    prompts = list(args.prompt)
    if args.prompts_file:
        try:
            with open(args.prompts_file, encoding="utf-8") as f:
                lines = [line.rstrip("\n") for line in f]
        except (OSError, UnicodeDecodeError) as e:
            reason = getattr(e, "strerror", None) or getattr(e, "reason", None) or e
            raise ValueError(f"--prompts-file {args.prompts_file!r} cannot be read as UTF-8 text ({reason}).") from None
        prompts += [line for line in lines if line]
        if not any(lines):
            raise ValueError(f"--prompts-file {args.prompts_file!r} holds no prompt; write one per line.")
    for i, text in enumerate(prompts):
        if not text:  # said before the run is read
            raise ValueError(f"prompt {i + 1} is empty; a prompt needs at least one token (leave --prompt out for "
                             f"the default, a newline).")
    return prompts or ["\n"]


def cmd_sample(args) -> int:
    from jdp.cpu import backends_started, use_cpu_devices

    prompts = _prompts(args)
    if not backends_started():
        use_cpu_devices(1)  # shapes only the CPU backend: one device decodes
    from jdp.run.sampling import load_run, sample

    run = load_run(args.workdir, log=lambda line: print(line, file=sys.stderr))
    done = sample(run, prompts, args.tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                  seed=args.seed)
    for i, (prompt, text) in enumerate(zip(prompts, done.texts)):
        print(("" if i == 0 else "\n" + "-" * 40 + "\n") + prompt + text)
    print(f"{len(prompts)} × {done.tokens} tokens from checkpoint {run.step} of {args.workdir} in {done.seconds:.2f} "
          f"s: {done.tokens_per_s:,.0f} tokens/s (compiled in {done.compile_seconds:.1f} s, left out)", file=sys.stderr)
    return 0


def add_export_parser(sub) -> None:
    """`jdp export WORKDIR OUT` (jdp.run.export, imported only when it runs)."""
    export = sub.add_parser(
        "export", help="write a GPT run as a Hugging Face GPT-2 directory (transformers' from_pretrained)",
        description="Write WORKDIR's newest intact checkpoint of a GPT run to OUT as a Hugging Face GPT-2 model: "
        "config.json and model.safetensors, and the run's tokenizer.json where it has one. "
        "transformers.GPT2LMHeadModel.from_pretrained(OUT) computes the same logits. OUT must not exist or be an "
        "empty directory; nothing in WORKDIR is written.")
    export.add_argument("workdir", metavar="WORKDIR", help="the run directory (jdp train's --workdir)")
    export.add_argument("out", metavar="OUT", help="the directory to write (new, or empty)")


def cmd_export(args) -> int:
    from jdp.cpu import backends_started, use_cpu_devices

    if not backends_started():
        use_cpu_devices(1)  # the checkpoint is read into one CPU device
    from jdp.run.export import export_lines, export_run

    done = export_run(args.workdir, args.out, log=lambda line: print(line, file=sys.stderr))
    for line in export_lines(done, args.workdir):
        print(line)
    return 0


def cmd_configs(args) -> int:
    from jdp.run.shipped import format_configs, shipped_configs

    print(format_configs(shipped_configs()), end="")
    return 0


def cmd_data(args) -> int:
    from jdp.data.prepare import prepare_from

    # data_command is "prepare-tokens", the only one
    print(prepare_from(args.input, args.output, val_fraction=args.val_fraction, dtype=args.dtype,
                       tokenizer=args.tokenizer, field=args.field, workers=args.workers, progress=not args.no_progress,
                       log=lambda line: print(line, flush=True), note=lambda line: print(line, file=sys.stderr)))
    return 0


__all__ = ["add_configs_parser", "add_data_parser", "add_export_parser", "add_sample_parser", "cmd_configs", "cmd_data",
           "cmd_export", "cmd_sample"]
