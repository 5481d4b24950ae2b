"""Turn a local text into nanoGPT-style token files, `train.bin` and `val.bin`, with a byte-level tokenizer.

    python -m jdp.examples.prepare_tokens --out runs/pyref_tokens        # the Python Language Reference text
    python -m jdp.examples.prepare_tokens --text my_corpus.txt --out runs/mine --val-fraction 0.05

The same as `jdp data prepare-tokens INPUT OUTPUT` (`jdp.data.prepare`, which ships with jdp and
says the format and the split), kept for scripts written against this example. It prints the token
counts and the files written, e.g. for the default text on Python 3.11.7:

    train.bin: 419,604 tokens (418,543 characters); val.bin: 46,591 tokens (46,505 characters); vocab_size 256 ...
"""
import argparse
import sys

from jdp.data.prepare import REFERENCE, prepare_from


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--text", default=REFERENCE, help="a UTF-8 text file (default: the Python Language Reference text)")
    ap.add_argument("--out", required=True, help="the folder to write train.bin and val.bin into")
    ap.add_argument("--val-fraction", type=float, default=0.1, help="the held-out share of characters (0.1)")
    args = ap.parse_args(argv)
    try:
        print(prepare_from(args.text, args.out, val_fraction=args.val_fraction))
    except ValueError as e:
        print(f"prepare_tokens: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
