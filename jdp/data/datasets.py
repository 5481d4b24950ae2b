"""The datasets jdp ships (nothing downloads): scikit-learn's digits, a character corpus, the seed regressions."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jdp.data.arrays import ArrayDataset
from jdp.data.checks import check_int

DIGITS_EXAMPLES = 1797  # scikit-learn's bundled digits, before the train/test split


def held_out_count(n: int, test_fraction: float) -> int:
    """How many of `n` examples a split holds out for testing: round(n · test_fraction)."""
    return int(round(n * test_fraction))


def load_digits(test_fraction: float = 0.2, seed: int = 0, *, images: bool = False):
    """scikit-learn's bundled 8×8 digits (DIGITS_EXAMPLES images): a fixed, shuffled train/test split.

    Returns `(x_train, y_train, x_test, y_test)`: x float32 in [0, 1] of shape (n, 64), or
    (n, 8, 8, 1) (height, width, channels) with `images=True`; y int32 of shape (n,).
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction={test_fraction} must be strictly between 0 and 1.")
    from sklearn.datasets import load_digits as sk_digits

    bunch = sk_digits()
    x = (bunch.data / 16.0).astype(np.float32)
    if images:
        x = x.reshape(-1, 8, 8, 1)
    y = bunch.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = held_out_count(len(x), test_fraction)
    test, train = order[:n_test], order[n_test:]
    return x[train], y[train], x[test], y[test]


@dataclass(frozen=True)
class CharCorpus:
    """A character-level corpus: the text, its vocabulary, and the text encoded as int32 ids."""

    text: str
    vocab: tuple[str, ...]  # the distinct characters, sorted; id i encodes vocab[i]
    train: np.ndarray  # (n_train,) int32: the first (1 - val_fraction) of the text
    val: np.ndarray  # (n_val,) int32: the rest

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> np.ndarray:
        """Ids of shape (len(text),), int32; a character outside the vocabulary raises ValueError."""
        index = {ch: i for i, ch in enumerate(self.vocab)}
        unknown = sorted(set(text) - index.keys())
        if unknown:
            raise ValueError(f"characters {unknown} are not in the corpus vocabulary of {self.vocab_size}.")
        return np.array([index[ch] for ch in text], np.int32)

    def decode(self, ids) -> str:
        """The text of ids of shape (k,)."""
        return "".join(self.vocab[int(i)] for i in np.asarray(ids).reshape(-1))


def reference_text() -> str:
    """The Python Language Reference's topic texts (`pydoc_data.topics`, shipped with Python), joined in
    sorted-key order with a newline between them: the text of `load_char_corpus`."""
    from pydoc_data.topics import topics

    return "\n".join(topics[key] for key in sorted(topics))


def load_char_corpus(val_fraction: float = 0.1) -> CharCorpus:
    """The Python Language Reference's topic texts that `help()` shows, as a character corpus.

    Reads one file of the standard library, `pydoc_data/topics.py` (imported as
    `pydoc_data.topics`): its dict `topics` holds 79 reference sections of English prose with
    code examples, joined here in sorted-key order with a newline between them. Python 3.11.7
    gives 465,048 characters over a 103-character vocabulary; other Python versions ship an
    edited text, so sizes differ slightly. `val` is the last `val_fraction` of the text.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction} must be strictly between 0 and 1.")
    text = reference_text()
    # Code points via UTF-32 keep the encoding vectorised: 0.5 M characters in milliseconds.
    codes = np.frombuffer(text.encode("utf-32-le"), np.uint32)
    uniq, ids = np.unique(codes, return_inverse=True)
    ids = ids.astype(np.int32)
    n_train = int(round(len(ids) * (1.0 - val_fraction)))
    return CharCorpus(text, tuple(chr(c) for c in uniq), ids[:n_train], ids[n_train:])


def char_windows(tokens: np.ndarray, context_length: int, *, stride: int = 1) -> ArrayDataset:
    """(input, target) windows of a token array of shape (n,) for next-token prediction.

    Returns an ArrayDataset with `"x"` and `"y"` of shape (m, context_length), `y[i] = x[i]`
    shifted by one token: window i starts at token `i·stride`, m = (n - context_length - 1) //
    stride + 1. Both are read-only views of `tokens` (no copy); a batch copies only its rows.
    """
    tokens = np.asarray(tokens)
    context_length = check_int("context_length", context_length, 1)
    stride = check_int("stride", stride, 1)
    if tokens.ndim != 1 or len(tokens) < context_length + 1:
        raise ValueError(f"tokens of shape {tokens.shape} are too short for one window of context_length="
                         f"{context_length}; it needs a 1-D array of at least {context_length + 1} tokens.")
    view = np.lib.stride_tricks.sliding_window_view
    return ArrayDataset({"x": view(tokens[:-1], context_length)[::stride],
                         "y": view(tokens[1:], context_length)[::stride]})


@dataclass(frozen=True)
class SeedRegression:
    """A regression small enough to step by hand: y = w·x, mean-squared error, one SGD step from `w0`.

    `devices` is how many devices split the examples equally in its worked example.
    """

    x: tuple  # (n,) or (n, features)
    t: tuple  # (n,) targets
    w0: float | tuple  # the initial weight(s)
    lr: float
    devices: int


# The seed regressions. 1: one device on the whole batch: grad -8.5, w -> 1.085; two devices,
# [2, 3] | [1, 4]: local grads -8.0 and -9.0, mean -8.5 (w -> 1.085), sum -17.0 (w -> 1.17).
# 2: four devices of two examples: local grads (-3.7, -3.5), (-1.7, -1.5), (-6.8, -6.0), (-4.4, -4.4),
# mean (-4.15, -3.85) (w -> (0.915, 0.085)), sum (-16.6, -15.4) (w -> (2.16, 1.24)).
SEED_REGRESSIONS = {
    1: SeedRegression(x=(2.0, 3.0, 1.0, 4.0), t=(3.0, 5.0, 2.0, 6.0), w0=1.0, lr=0.01, devices=2),
    2: SeedRegression(x=((1, 2), (2, 1), (.5, 1.5), (1.5, .5), (3, 1), (1, 3), (2, 2), (.5, .5)),
                      t=(1, 2, .5, 1.5, 3, 1, 2.5, .5), w0=(0.5, -0.3), lr=0.1, devices=4),
}


def load_seed_regression(number: int) -> ArrayDataset:
    """Seed regression `number` (1 or 2, see SEED_REGRESSIONS) as `{"x", "t"}` float32 arrays."""
    seed = SEED_REGRESSIONS.get(number) if isinstance(number, int) else None
    if seed is None:
        raise ValueError(f"number={number!r} names no seed example; use 1 or 2.")
    return ArrayDataset({"x": np.array(seed.x, np.float32), "t": np.array(seed.t, np.float32)})
