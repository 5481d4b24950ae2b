"""Turn a local text into nanoGPT-style token files, `train.bin` and `val.bin`, with a byte-level tokenizer.

    python examples/prepare_tokens.py --out runs/pyref_tokens        # the Python Language Reference text
    python examples/prepare_tokens.py --text my_corpus.txt --out runs/mine --val-fraction 0.05

The tokenizer is the identity on bytes: each token is one byte of the text's UTF-8 encoding, so the
vocabulary is 256 ids (`data.vocab_size: 256`) and decoding is `bytes(ids).decode("utf-8")`.
Both files are flat uint16 arrays (`data.dtype: uint16`, nanoGPT's format): token i is the
little-endian 16-bit integer at byte 2·i, no header.

The split is made on characters, as `jdp.data.load_char_corpus` makes it: `val.bin` holds the last
`val_fraction` of the text's characters (rounded), `train.bin` the rest, each then encoded. Without
`--text` the text is the one `load_char_corpus` reads (the Python Language Reference's topics,
shipped with Python in `pydoc_data.topics`), so the two corpora hold the same characters in the
same split; nothing downloads.

It prints the token counts and the files written, e.g. for the default text on Python 3.11.7:

    train.bin: 419,604 tokens (418,543 characters); val.bin: 46,591 tokens (46,505 characters); vocab_size 256 ...
"""
import argparse
import os
import sys

import numpy as np


def reference_text() -> str:
    """The Python Language Reference's topic texts, joined as `jdp.data.load_char_corpus` joins them."""
    from pydoc_data.topics import topics

    return "\n".join(topics[key] for key in sorted(topics))


def byte_tokens(text: str) -> np.ndarray:
    """The UTF-8 bytes of `text` as uint16 token ids, shape (bytes,)."""
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.uint16)


def prepare(text: str, out: str, val_fraction: float) -> dict:
    """Write `out/train.bin` and `out/val.bin`; returns their token and character counts."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"--val-fraction {val_fraction} must be strictly between 0 and 1.")
    n_train = int(round(len(text) * (1.0 - val_fraction)))
    os.makedirs(out, exist_ok=True)
    counts = {}
    for name, part in (("train", text[:n_train]), ("val", text[n_train:])):
        tokens = byte_tokens(part)
        tokens.astype("<u2").tofile(os.path.join(out, f"{name}.bin"))
        counts[name] = (len(tokens), len(part))
    return counts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--text", help="a UTF-8 text file (default: the Python Language Reference text)")
    ap.add_argument("--out", required=True, help="the folder to write train.bin and val.bin into")
    ap.add_argument("--val-fraction", type=float, default=0.1, help="the held-out share of characters (0.1)")
    args = ap.parse_args(argv)
    try:
        if args.text is None:
            text = reference_text()
        else:
            with open(args.text, encoding="utf-8") as f:
                text = f.read()
        counts = prepare(text, args.out, args.val_fraction)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        print(f"prepare_tokens: error: {e}", file=sys.stderr)
        return 2
    (nt, ct), (nv, cv) = counts["train"], counts["val"]
    print(f"train.bin: {nt:,} tokens ({ct:,} characters); val.bin: {nv:,} tokens ({cv:,} characters); "
          f"vocab_size 256 -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
