"""The order in which an epoch visits n examples: a bijection of [0, n), a function of (seed, epoch, n) only.

Two orders, one per need:

- `"permutation"` (`epoch_order`): numpy's `permutation(n)` from a generator seeded with
  `SeedSequence([seed, epoch])`, computed once per epoch and kept: 8 bytes per example (8 GB at
  n = 10^9). The order of in-memory arrays (`ArrayDataset`), unchanged since jdp's first release,
  so every existing run keeps its batches and its checkpoints.
- `"bijection"` (`shuffled_positions`): a keyed Feistel network on the smallest even number of
  bits covering n, with cycle walking into [0, n): position i of the epoch holds example
  `F(i)`, computed per batch for just the positions it needs, vectorised in numpy (O(batch) time
  and memory, nothing per example). The default of every other source (grain datasets,
  token files, ArrayRecord). Its round keys are `SeedSequence([seed, epoch]).generate_state(6)`.

grain's `MapDataset.shuffle` is also an index bijection, but it is computed one index per Python
call (2–5 ms per batch of 256 here) and its per-epoch key `seed + epoch` would make run `seed=1`
replay run `seed=0` one epoch late.
"""
from __future__ import annotations

import numpy as np

ORDERS = ("permutation", "bijection")
ROUNDS = 6  # Feistel rounds; 4 already make a pseudorandom permutation (Luby–Rackoff)
_M1, _M2, _GOLDEN = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), np.uint64(0x9E3779B97F4A7C15)


def epoch_order(seed: int, epoch: int, n: int) -> np.ndarray:
    """The order in which epoch `epoch` visits `n` examples: a permutation of `arange(n)`, int64 `(n,)`.

    A function of `(seed, epoch, n)` only: numpy's `Generator.permutation` seeded with
    `SeedSequence([seed, epoch])`, whose output numpy keeps stable across versions.
    """
    return np.random.default_rng(np.random.SeedSequence([seed, epoch])).permutation(n)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (wrapping arithmetic): a well-mixed hash of each value."""
    z = z + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def _feistel(x: np.ndarray, keys: np.ndarray, half: int) -> np.ndarray:
    """A bijection of [0, 4^half) applied to uint64 `x`: ROUNDS balanced Feistel rounds."""
    shift, mask = np.uint64(half), np.uint64((1 << half) - 1)
    left, right = x >> shift, x & mask
    for key in keys:
        left, right = right, left ^ (_mix(right ^ key) & mask)
    return (left << shift) | right


def shuffled_positions(seed: int, epoch: int, n: int, positions: np.ndarray) -> np.ndarray:
    """The examples at `positions` (int, shape (k,), each in [0, n)) of epoch `epoch`'s order, int64 `(k,)`.

    The order is a bijection of [0, n) determined by `(seed, epoch, n)`: over all n positions every
    example appears once. Costs O(k) time and memory; nothing is kept between calls.
    """
    positions = np.asarray(positions, np.int64)
    if positions.size and (positions.min() < 0 or positions.max() >= n):
        raise ValueError(f"positions must lie in [0, {n}), got values from {positions.min()} to {positions.max()}.")
    half = max(1, (int(n - 1).bit_length() + 1) // 2)  # 4^half >= n
    keys = np.random.SeedSequence([seed, epoch]).generate_state(ROUNDS, np.uint64)
    y = _feistel(positions.astype(np.uint64), keys, half)
    outside = y >= np.uint64(n)
    while outside.any():  # cycle walking: apply F again until the value lands in [0, n)
        y[outside] = _feistel(y[outside], keys, half)
        outside = y >= np.uint64(n)
    return y.astype(np.int64)


class EpochOrder:
    """`order(epoch, positions) -> examples` for one named order ("permutation" or "bijection") over n examples.

    "permutation" keeps the current epoch's permutation (n int64); "bijection" keeps nothing.
    """

    def __init__(self, name: str, seed: int, n: int):
        if name not in ORDERS:
            raise ValueError(f"order={name!r} is not an epoch order; use one of {', '.join(map(repr, ORDERS))}.")
        self.name, self.seed, self.n = name, seed, n
        self._cached = (-1, np.empty(0, np.int64))  # (epoch, its permutation): replaced whole, so thread-safe

    def __call__(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """The examples at `positions` (in [0, n)) of epoch `epoch`, int64 of the same shape."""
        if self.name == "bijection":
            return shuffled_positions(self.seed, epoch, self.n, positions)
        cached_epoch, order = self._cached
        if cached_epoch != epoch:
            order = epoch_order(self.seed, epoch, self.n)
            self._cached = (epoch, order)
        return order[positions]

    def __getstate__(self):  # a worker process recomputes the permutation rather than receive it
        return {"name": self.name, "seed": self.seed, "n": self.n}

    def __setstate__(self, state):
        self.__init__(state["name"], state["seed"], state["n"])
