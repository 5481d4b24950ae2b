"""`jdp configs` and `jdp data prepare-tokens`: what ships with jdp, for `jdp train` (jdp.run.cli adds them).

Their parsers import nothing heavy, so `jdp --help` stays instant; the commands import their
modules when they run.
"""
from __future__ import annotations


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
        "and meta.json (vocab size, dtype, tokenizer, the inputs' sha256), which jdp train reads. The INPUTs are "
        "read piece by piece, never whole; val.bin holds the last --val-fraction of their characters. Nothing "
        "in OUTPUT is ever overwritten.")
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
    tokens.add_argument("--no-progress", action="store_true", help="no progress bar (it shows on a terminal only)")


def cmd_configs(args) -> int:
    from jdp.run.shipped import format_configs, shipped_configs

    print(format_configs(shipped_configs()), end="")
    return 0


def cmd_data(args) -> int:
    from jdp.data.prepare import prepare_from

    # data_command is "prepare-tokens", the only one
    print(prepare_from(args.input, args.output, val_fraction=args.val_fraction, dtype=args.dtype,
                       tokenizer=args.tokenizer, field=args.field, progress=not args.no_progress,
                       log=lambda line: print(line, flush=True)))
    return 0


__all__ = ["add_configs_parser", "add_data_parser", "cmd_configs", "cmd_data"]
