"""The input pipeline: offline datasets as host numpy arrays, and sharded, resumable global batches.

The contract: the global batch at step `s` of epoch `e` is a
function of `(seed, e, s)` only, never of the number of processes or devices, so a run on 8
devices sees exactly the examples a run on 1 device sees, in the same order.

- Epoch `e` visits the examples in its own order: numpy's `permutation(n)` from a generator
  seeded with `SeedSequence([seed, e])`, computed once per epoch and kept (8 bytes per example).
  (grain's `MapDataset.shuffle` was the first choice, but it permutes one index per Python call:
  2–5 ms per batch of 256 under the GIL, which a training step of 10 ms cannot hide; this
  permutation and gather take 0.04 ms. grain's own per-epoch key, `seed + e`, would also make
  run `seed=1` replay run `seed=0` one epoch late.)
- Global batch `s` holds the examples at positions `[s·G, (s+1)·G)` of that order. Process `p` of
  `P` loads only rows `[p·G/P, (p+1)·G/P)` of it, positions `[(s·P + p)·G/P, (s·P + p + 1)·G/P)`.
  Only those rows are gathered; `TrainStep.shard_batch` then splits them over the devices.
  With `drop_last=False` the last global batch runs past the end of the order, and position
  `i ≥ n` takes example `order[i mod n]`, marked 0.0 in `"mask"`.
- grain's `to_iter_dataset` iterator yields the batches (optionally computed ahead in a thread)
  and counts them; `BatchIterator.get_state()` turns its count into `{"epoch", "step", ...}`.

Why not grain's `IndexSampler` + `DataLoader`: `ShardOptions` shards *records*
(process `p` reads records `[p·n/P, (p+1)·n/P)`, shuffled among themselves), so the global batch
would change with the process count; and `DataLoader`'s `Batch` runs over one endless record
stream, so batches straddle epochs and there is no per-epoch tail to drop or pad.

Datasets (nothing downloads): `load_digits` (scikit-learn's bundled 8×8 digits, flat or as
images), `load_char_corpus` + `char_windows` (a character-level text for a small GPT),
`load_seed_regression` (the seed regressions, `SEED_REGRESSIONS`: y = w·x, one SGD step whose
numbers are known by hand), `load_arrays` (a user's `.npz`/`.npy`).
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import grain
import numpy as np

from jdp.npyfile import read_arrays
from jdp.sections import quoted, shorten

MASK_KEY = "mask"  # added to every batch when drop_last=False: 1.0 real example, 0.0 padding


@dataclass(frozen=True)
class ArrayDataset:
    """Named host arrays that share a leading example axis: `arrays[k].shape == (n, ...)`, n ≥ 1."""

    arrays: Mapping[str, np.ndarray]

    def __post_init__(self):
        if not isinstance(self.arrays, Mapping) or not self.arrays:
            raise ValueError(f"a dataset needs a non-empty dict of named arrays, got {_describe(self.arrays)}.")
        arrays = {str(k): np.asarray(v) for k, v in self.arrays.items()}
        for k, v in arrays.items():
            if v.ndim == 0:
                raise ValueError(f"array {quoted(k)} is a scalar; every array needs a leading example axis.")
            if v.dtype == object:
                raise ValueError(f"array {quoted(k)} has dtype object; only numeric and bool arrays are allowed.")
        lengths = {k: len(v) for k, v in arrays.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"arrays have mismatched lengths {shorten(str(lengths))}; every array needs the same "
                             f"number of examples along axis 0.")
        if next(iter(lengths.values())) == 0:
            raise ValueError(f"the dataset is empty (0 examples in {shorten(str(sorted(arrays)))}); it needs at "
                             f"least one.")
        object.__setattr__(self, "arrays", arrays)

    def __len__(self) -> int:
        """The number of examples n."""
        return len(next(iter(self.arrays.values())))

    def take(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """Rows `indices` (shape (k,)) of every array: a dict of new arrays of shape (k, ...)."""
        return {k: v[indices] for k, v in self.arrays.items()}


def _describe(value) -> str:
    return "an empty dict" if isinstance(value, Mapping) else f"a {type(value).__name__}"


def _as_dataset(data: ArrayDataset | Mapping[str, np.ndarray]) -> ArrayDataset:
    return data if isinstance(data, ArrayDataset) else ArrayDataset(data)


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _check_int(name: str, value, minimum: int) -> int:
    if not _is_int(value) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer of at least {minimum}.")
    return int(value)


def epoch_order(seed: int, epoch: int, n: int) -> np.ndarray:
    """The order in which epoch `epoch` visits `n` examples: a permutation of `arange(n)`, int64 `(n,)`.

    A function of `(seed, epoch, n)` only: numpy's `Generator.permutation` seeded with
    `SeedSequence([seed, epoch])`, whose output numpy keeps stable across versions.
    """
    return np.random.default_rng(np.random.SeedSequence([seed, epoch])).permutation(n)


class BatchIterator:
    """Endless iterator over this process's slice of each global batch, epoch after epoch.

    Each item is a dict with the dataset's keys, every array of shape `(G/P, ...)` (G = global
    batch size, P = processes): rows `[p·G/P, (p+1)·G/P)` of global batch `step` of `epoch`, in
    order. With `drop_last=False` it also holds `"mask"`, float32 of shape `(G/P,)`.

    `epoch` and `step` name the batch that `next()` returns next; `steps_per_epoch` is
    `n // G` (drop_last=True) or `ceil(n / G)` (drop_last=False). Build it with `make_batches`.
    """

    def __init__(self, dataset: ArrayDataset, global_batch_size: int, *, seed: int, drop_last: bool,
                 process_index: int, num_processes: int, prefetch: int):
        self.dataset = dataset
        self.global_batch_size = _check_int("global_batch_size", global_batch_size, 1)
        self.num_processes = _check_int("num_processes", num_processes, 1)
        if not _is_int(process_index) or not 0 <= process_index < self.num_processes:
            raise ValueError(f"process_index={process_index!r} is out of range for num_processes="
                             f"{self.num_processes}; use an integer from 0 to {self.num_processes - 1}.")
        self.process_index = int(process_index)
        if self.global_batch_size % self.num_processes:
            raise ValueError(f"global_batch_size={self.global_batch_size} does not split evenly across "
                             f"num_processes={self.num_processes}; use a multiple of {self.num_processes}.")
        self.seed = _check_int("seed", seed, 0)
        self.drop_last = bool(drop_last)
        prefetch = _check_int("prefetch", prefetch, 0)
        n = len(dataset)
        if self.drop_last and n < self.global_batch_size:
            raise ValueError(f"the dataset has {n} examples, fewer than one global batch of "
                             f"{self.global_batch_size} with drop_last=True; use global_batch_size <= {n} "
                             f"or drop_last=False.")
        if not self.drop_last and MASK_KEY in dataset.arrays:
            raise ValueError(f"the dataset already has an array named {MASK_KEY!r}, which drop_last=False "
                             f"adds to every batch; rename that array.")
        self.local_batch_size = self.global_batch_size // self.num_processes
        self.steps_per_epoch = n // self.global_batch_size if self.drop_last else -(-n // self.global_batch_size)
        # Global step t = epoch·K + step is the index into an endless grain dataset; grain's iterator
        # keeps t as its whole state ("next_index") and can compute batches ahead in a thread.
        batches = grain.MapDataset.range(self.steps_per_epoch).repeat()
        batches = batches.map_with_index(lambda t, _: self._load(t))
        options = grain.ReadOptions(num_threads=1 if prefetch else 0, prefetch_buffer_size=prefetch)
        self._order = (-1, np.empty(0, np.int64))  # (epoch, its order): replaced whole, so thread-safe
        self._it = iter(batches.to_iter_dataset(options))

    def _load(self, t: int) -> dict[str, np.ndarray]:
        epoch, step = divmod(t, self.steps_per_epoch)
        n = len(self.dataset)
        cached_epoch, order = self._order
        if cached_epoch != epoch:
            order = epoch_order(self.seed, epoch, n)
            self._order = (epoch, order)
        c = step * self.num_processes + self.process_index  # this slice is chunk c of the epoch's order
        positions = c * self.local_batch_size + np.arange(self.local_batch_size)
        # Epoch positions i ≥ n (the padding of the last batch) wrap to order[i mod n]: real examples
        # keep every loss finite, the mask zeroes them, and they too depend on (seed, epoch, step) only.
        batch = self.dataset.take(order[positions % n])
        if not self.drop_last:
            batch[MASK_KEY] = (positions < n).astype(np.float32)
        return batch

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        return next(self._it)

    @property
    def epoch(self) -> int:
        """The epoch of the batch `next()` returns next."""
        return self._it.get_state()["next_index"] // self.steps_per_epoch

    @property
    def step(self) -> int:
        """The step within its epoch (0 ≤ step < steps_per_epoch) of the batch `next()` returns next."""
        return self._it.get_state()["next_index"] % self.steps_per_epoch

    def get_state(self) -> dict:
        """The position as a small JSON-serialisable dict, for checkpoints.

        It holds no process index or count: a state saved by any process of a P-process run resumes
        the same global-batch sequence on any number of processes.
        """
        return {"epoch": self.epoch, "step": self.step, "seed": self.seed,
                "global_batch_size": self.global_batch_size, "num_examples": len(self.dataset),
                "drop_last": self.drop_last}

    def set_state(self, state: Mapping) -> None:
        """Continue from a `get_state()` dict: the next batch is global batch `state["step"]` of `state["epoch"]`."""
        expected = self.get_state()
        if not isinstance(state, Mapping) or set(state) != set(expected):
            keys = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(f"a data state needs exactly the keys {sorted(expected)}, got {keys}.")
        for key in ("seed", "global_batch_size", "num_examples", "drop_last"):
            if state[key] != expected[key]:
                raise ValueError(f"the saved data state has {key}={state[key]!r} but this iterator has "
                                 f"{key}={expected[key]!r}; resume with the same dataset and settings.")
        epoch = _check_int("state epoch", state["epoch"], 0)
        step = _check_int("state step", state["step"], 0)
        if step >= self.steps_per_epoch:
            raise ValueError(f"state step={step} is out of range for {self.steps_per_epoch} steps per epoch; "
                             f"use 0 to {self.steps_per_epoch - 1}.")
        self._it.set_state({"next_index": epoch * self.steps_per_epoch + step})

    def close(self) -> None:
        """Stop grain's prefetch thread; the iterator cannot be used afterwards."""
        self._it.close()


def make_batches(dataset: ArrayDataset | Mapping[str, np.ndarray], global_batch_size: int, *, seed: int = 0,
                 drop_last: bool = True, process_index: int = 0, num_processes: int = 1,
                 start_state: Mapping | None = None, prefetch: int = 2) -> BatchIterator:
    """This process's slices of the global batches of `dataset`, epoch after epoch, from `start_state`.

    `dataset`: an `ArrayDataset` or a dict of arrays of shape `(n, ...)`. Global batch `s` of epoch
    `e` holds `global_batch_size` (G) examples determined by `(seed, e, s)` alone; this process
    (`process_index` p of `num_processes` P; in a multi-process JAX run pass `jax.process_index()`
    and `jax.process_count()`) gets its rows `[p·G/P, (p+1)·G/P)`, each array shaped `(G/P, ...)`.
    Hand them to the step as they are: it splits the leading axis evenly over the devices.

    - `drop_last=True`: the last, incomplete global batch of each epoch is skipped; batches have
      no `"mask"`.
    - `drop_last=False`: the last global batch is padded to G with the epoch's first examples and
      every batch gets `"mask"`, float32 `(G/P,)`, 1.0 for a real example and 0.0 for padding. The loss
      must then be `sum(mask · per_example_loss) / b_local` (b_local: the device's rows, padding
      included), which jdp's step rescales by the count of real examples, so the mean over the
      real examples stays exact. Padding rows still pass through the model (e.g. BatchNorm
      statistics see them).

    `prefetch` batches are computed ahead in one grain thread (0: on demand, in this thread).
    Raises ValueError for G < 1, P < 1, p outside [0, P), G not divisible by P, or fewer than G
    examples with drop_last=True.
    """
    it = BatchIterator(_as_dataset(dataset), global_batch_size, seed=seed, drop_last=drop_last,
                       process_index=process_index, num_processes=num_processes, prefetch=prefetch)
    if start_state is not None:
        it.set_state(start_state)
    return it


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
    from pydoc_data.topics import topics

    text = "\n".join(topics[key] for key in sorted(topics))
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
    context_length = _check_int("context_length", context_length, 1)
    stride = _check_int("stride", stride, 1)
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


def load_arrays(path: str | os.PathLike, *, key: str = "x") -> ArrayDataset:
    """A user's arrays from a `.npz` (every array it holds, by name) or `.npy` file (one array, named `key`).

    Read by `jdp.npyfile.read_arrays` (`allow_pickle=False`, every header checked against the file
    before numpy allocates). Raises ValueError for a missing file, another suffix, an object array
    (numpy pickles those), a header claiming more than its file holds or than the machine's memory,
    a file that is not numpy's format, or arrays of different lengths.
    """
    arrays = read_arrays(path, key=key)
    try:
        return ArrayDataset(arrays)
    except ValueError as e:
        raise ValueError(f"{quoted(os.fspath(path))}: {e}") from None
