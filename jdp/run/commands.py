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
        "prepare-tokens", help="byte-level token files (train.bin, val.bin) from a text",
        description="Write OUTPUT/train.bin and OUTPUT/val.bin, the format data.name tokens reads (nanoGPT's): "
        "the UTF-8 bytes of the text as token ids (vocab_size 256), each a little-endian unsigned integer of --dtype, "
        "no header. val.bin holds the last --val-fraction of the characters. Token files already in OUTPUT are "
        "never overwritten.")
    tokens.add_argument("input", metavar="INPUT", help="a UTF-8 text file, or python-reference for the Python "
                        "Language Reference text that ships with Python (jdp.data.load_char_corpus's text)")
    tokens.add_argument("output", metavar="OUTPUT", help="the folder to write train.bin and val.bin into")
    tokens.add_argument("--dtype", default="uint16", help="the token files' integer type: uint16 (default) or uint32")
    tokens.add_argument("--val-fraction", type=float, default=0.1, help="the held-out share of characters (0.1)")


def cmd_configs(args) -> int:
    from jdp.run.shipped import format_configs, shipped_configs

    print(format_configs(shipped_configs()), end="")
    return 0


def cmd_data(args) -> int:
    from jdp.data.prepare import prepare_from

    # data_command is "prepare-tokens", the only one
    print(prepare_from(args.input, args.output, val_fraction=args.val_fraction, dtype=args.dtype))
    return 0


__all__ = ["add_configs_parser", "add_data_parser", "cmd_configs", "cmd_data"]
