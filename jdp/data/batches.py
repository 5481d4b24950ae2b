"""Sharded, resumable global batches of any source, the same on any number of devices and processes.

The contract: the global batch at step `s` of epoch `e` is a function of `(seed, e, s)` only,
never of the number of processes or devices, so a run on 8 devices sees exactly the examples a
run on 1 device sees, in the same order.

- Epoch `e` visits the n examples in the order `jdp.data.order` defines: for in-memory arrays
  numpy's `permutation(n)` seeded with `SeedSequence([seed, e])` (as always); for every other
  source a Feistel bijection computed per batch (no O(n) memory).
- Global batch `s` holds the examples at positions `[s·G, (s+1)·G)` of that order. Process `p` of
  `P` loads only rows `[p·G/P, (p+1)·G/P)` of it, positions `[(s·P + p)·G/P, (s·P + p + 1)·G/P)`.
  Only those examples are read; `TrainStep.shard_batch` then splits them over the devices.
  With `drop_last=False` the last global batch runs past the end of the order, and position
  `i ≥ n` takes example `order[i mod n]`, marked 0.0 in `"mask"`.
- A `transform(example, rng)` runs on each example after it is read, with
  `rng = numpy.random.default_rng(SeedSequence([seed, e, index]))` (index: the example's index in
  the source), so augmentations too depend on `(seed, e, index)` only.
- Batches are computed ahead by grain: in threads of this process (`prefetch`, `threads`), or in
  grain worker processes (`workers`), which share nothing with the step and are not limited by the
  GIL. Either way the batches are the same, in the same order.

Why not grain's `IndexSampler` + `DataLoader`: `ShardOptions` shards *records*
(process `p` reads records `[p·n/P, (p+1)·n/P)`, shuffled among themselves), so the global batch
would change with the process count; and `DataLoader`'s `Batch` runs over one endless record
stream, so batches straddle epochs and there is no per-epoch tail to drop or pad.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from jdp.data.checks import check_int, is_int
from jdp.data.order import EpochOrder
from jdp.data.sources import as_source, spec_of, stack_items

MASK_KEY = "mask"  # added to every batch when drop_last=False: 1.0 real example, 0.0 padding
_ENDLESS = 1 << 62  # global steps the grain pipeline counts to: "forever"


def example_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    """The generator a transform gets for example `index` in epoch `epoch`: SeedSequence([seed, epoch, index])."""
    return np.random.default_rng(np.random.SeedSequence([seed, epoch, int(index)]))


class _Loader:
    """Global step t -> this process's slice of global batch t; picklable, so grain workers can run it."""

    def __init__(self, source, order: EpochOrder, transform, spec, *, local_batch_size: int, num_processes: int,
                 process_index: int, steps_per_epoch: int, drop_last: bool):
        self.source, self.order, self.transform, self.spec = source, order, transform, spec
        self.local_batch_size, self.num_processes, self.process_index = local_batch_size, num_processes, process_index
        self.steps_per_epoch, self.drop_last = steps_per_epoch, drop_last

    def __call__(self, t: int) -> dict[str, np.ndarray]:
        epoch, step = divmod(int(t), self.steps_per_epoch)
        n = len(self.source)
        c = step * self.num_processes + self.process_index  # this slice is chunk c of the epoch's order
        positions = c * self.local_batch_size + np.arange(self.local_batch_size)
        # Epoch positions i ≥ n (the padding of the last batch) wrap to order[i mod n]: real examples
        # keep every loss finite, the mask zeroes them, and they too depend on (seed, epoch, step) only.
        indices = self.order(epoch, positions % n)
        if self.transform is None:
            batch = self.source.take(indices)
        else:
            seed = self.order.seed
            items = [self.transform(self.source[int(i)], example_rng(seed, epoch, i)) for i in indices]
            batch = stack_items(items, indices, self.spec)
        if not self.drop_last:
            batch[MASK_KEY] = (positions < n).astype(np.float32)
        return batch


def _transformed_spec(source, transform, seed: int) -> dict:
    """`{key: (shape, dtype)}` every batch must have: the source's, or that of transform(example 0) in epoch 0."""
    if transform is None:
        return source.spec()
    if not callable(transform):
        raise ValueError(f"transform must be callable as transform(example, rng), got {type(transform).__name__}.")
    return spec_of(transform(source[0], example_rng(seed, 0, 0)), "transform(item 0, rng)")


class BatchIterator:
    """Endless iterator over this process's slice of each global batch, epoch after epoch.

    Each item is a dict with the source's keys, every array of shape `(G/P, ...)` (G = global
    batch size, P = processes): rows `[p·G/P, (p+1)·G/P)` of global batch `step` of `epoch`, in
    order. With `drop_last=False` it also holds `"mask"`, float32 of shape `(G/P,)`.

    `epoch` and `step` name the batch that `next()` returns next; `steps_per_epoch` is
    `n // G` (drop_last=True) or `ceil(n / G)` (drop_last=False). Build it with `make_batches`.
    """

    def __init__(self, source, global_batch_size: int, *, seed: int, drop_last: bool, process_index: int,
                 num_processes: int, prefetch: int, threads: int = 1, workers: int = 0, order: str | None = None,
                 transform: Callable | None = None):
        self.source = source
        self.global_batch_size = check_int("global_batch_size", global_batch_size, 1)
        self.num_processes = check_int("num_processes", num_processes, 1)
        if not is_int(process_index) or not 0 <= process_index < self.num_processes:
            raise ValueError(f"process_index={process_index!r} is out of range for num_processes="
                             f"{self.num_processes}; use an integer from 0 to {self.num_processes - 1}.")
        self.process_index = int(process_index)
        if self.global_batch_size % self.num_processes:
            raise ValueError(f"global_batch_size={self.global_batch_size} does not split evenly across "
                             f"num_processes={self.num_processes}; use a multiple of {self.num_processes}.")
        self.seed = check_int("seed", seed, 0)
        self.drop_last = bool(drop_last)
        self.prefetch, self.threads = check_int("prefetch", prefetch, 0), check_int("threads", threads, 1)
        self.workers = check_int("workers", workers, 0)
        n = len(source)
        if self.drop_last and n < self.global_batch_size:
            raise ValueError(f"the dataset has {n} examples, fewer than one global batch of "
                             f"{self.global_batch_size} with drop_last=True; use global_batch_size <= {n} "
                             f"or drop_last=False.")
        spec = _transformed_spec(source, transform, self.seed)
        if not self.drop_last and MASK_KEY in spec:
            raise ValueError(f"the dataset already has an array named {MASK_KEY!r}, which drop_last=False "
                             f"adds to every batch; rename that array.")
        self.order = EpochOrder(getattr(source, "default_order", "bijection") if order is None else order, self.seed, n)
        self.local_batch_size = self.global_batch_size // self.num_processes
        self.steps_per_epoch = n // self.global_batch_size if self.drop_last else -(-n // self.global_batch_size)
        self._load = _Loader(source, self.order, transform, spec, local_batch_size=self.local_batch_size,
                             num_processes=self.num_processes, process_index=self.process_index,
                             steps_per_epoch=self.steps_per_epoch, drop_last=self.drop_last)
        self._next = 0  # the global step (epoch·K + step) next() returns
        self._it = None  # grain's iterator from global step self._next, built on the first next()

    def _start(self):
        """grain's pipeline over global steps self._next, self._next + 1, ...: threads or worker processes."""
        import grain  # ~0.5 s to import: only once batches are read

        steps = grain.MapDataset.range(self._next, _ENDLESS).map(self._load)
        options = grain.ReadOptions(num_threads=self.threads if self.prefetch else 0,
                                    prefetch_buffer_size=self.prefetch)
        stream = steps.to_iter_dataset(options)
        if self.workers:
            from absl import flags

            if not flags.FLAGS.is_parsed():  # grain's workers read absl flags, which only absl's app.run parses
                flags.FLAGS.mark_as_parsed()
            stream = stream.mp_prefetch(grain.MultiprocessingOptions(
                num_workers=self.workers, per_worker_buffer_size=max(1, self.prefetch)))
        return iter(stream)

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if self._it is None:
            self._it = self._start()
        batch = next(self._it)
        self._next += 1
        return batch

    @property
    def epoch(self) -> int:
        """The epoch of the batch `next()` returns next."""
        return self._next // self.steps_per_epoch

    @property
    def step(self) -> int:
        """The step within its epoch (0 ≤ step < steps_per_epoch) of the batch `next()` returns next."""
        return self._next % self.steps_per_epoch

    def get_state(self) -> dict:
        """The position as a small JSON-serialisable dict, for checkpoints.

        It holds no process index or count, nor the threads or workers: a state saved by any
        process of a P-process run resumes the same global-batch sequence on any number of processes.
        """
        return {"epoch": self.epoch, "step": self.step, "seed": self.seed,
                "global_batch_size": self.global_batch_size, "num_examples": len(self.source),
                "drop_last": self.drop_last, "order": self.order.name}

    def set_state(self, state: Mapping) -> None:
        """Continue from a `get_state()` dict: the next batch is global batch `state["step"]` of `state["epoch"]`.

        A state without "order" (saved before jdp had a second order) is one of the "permutation".
        """
        expected = self.get_state()
        if isinstance(state, Mapping) and "order" not in state:
            state = {**state, "order": "permutation"}
        if not isinstance(state, Mapping) or set(state) != set(expected):
            keys = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(f"a data state needs exactly the keys {sorted(expected)}, got {keys}.")
        for key in ("seed", "global_batch_size", "num_examples", "drop_last", "order"):
            if state[key] != expected[key]:
                raise ValueError(f"the saved data state has {key}={state[key]!r} but this iterator has "
                                 f"{key}={expected[key]!r}; resume with the same dataset and settings.")
        epoch = check_int("state epoch", state["epoch"], 0)
        step = check_int("state step", state["step"], 0)
        if step >= self.steps_per_epoch:
            raise ValueError(f"state step={step} is out of range for {self.steps_per_epoch} steps per epoch; "
                             f"use 0 to {self.steps_per_epoch - 1}.")
        self.close()
        self._next = epoch * self.steps_per_epoch + step

    def close(self) -> None:
        """Stop grain's threads or worker processes; the next `next()` (if any) starts them again."""
        if self._it is not None:
            self._it.close()
            self._it = None


def make_batches(dataset, global_batch_size: int, *, seed: int = 0, drop_last: bool = True, process_index: int = 0,
                 num_processes: int = 1, start_state: Mapping | None = None, prefetch: int = 2, threads: int = 1,
                 workers: int = 0, order: str | None = None, transform: Callable | None = None) -> BatchIterator:
    """This process's slices of the global batches of `dataset`, epoch after epoch, from `start_state`.

    `dataset`: a dict of arrays of shape `(n, ...)` or an `ArrayDataset`; a `grain.MapDataset` or
    any object with `__len__` and `__getitem__(i) -> {key: array}` (every item with the keys,
    shapes and dtypes of item 0); `jdp.data.load_tokens(...)`, `jdp.data.load_array_record(...)`.
    Global batch `s` of epoch `e` holds `global_batch_size` (G) examples determined by `(seed, e, s)`
    alone; this process (`process_index` p of `num_processes` P; in a multi-process JAX run pass
    `jax.process_index()` and `jax.process_count()`) gets its rows `[p·G/P, (p+1)·G/P)`, each array
    shaped `(G/P, ...)`, and reads only those examples. Hand them to the step as they are: it splits
    the leading axis evenly over the devices.

    - `drop_last=True`: the last, incomplete global batch of each epoch is skipped; batches have
      no `"mask"`.
    - `drop_last=False`: the last global batch is padded to G with the epoch's first examples and
      every batch gets `"mask"`, float32 `(G/P,)`, 1.0 for a real example and 0.0 for padding. The loss
      must then be `sum(mask · per_example_loss) / b_local` (b_local: the device's rows, padding
      included) with the step's `mask_key="mask"`, which divides by the count of real examples,
      so the mean over the real examples stays exact (or a `jdp.Weighted(sum(mask · l), sum(mask))`
      loss, which needs no mask_key). Padding rows still pass through the model (e.g. BatchNorm
      statistics see them).

    `transform(example, rng) -> example` runs on every example as it is read (`rng` seeded from
    `(seed, epoch, index)`, see `example_rng`); its outputs must all have the keys, shapes and dtypes
    of its output for example 0 in epoch 0. `order`: "permutation" or "bijection" (`jdp.data.order`);
    None picks the source's own (arrays: "permutation"; every other source: "bijection").
    `prefetch` batches are computed ahead, by `threads` grain threads (0: on demand, in this thread),
    or by `workers` grain worker processes when `workers > 0` (the source and transform are pickled
    to them; a token file is reopened there). None of these change the batches.
    Raises ValueError for G < 1, P < 1, p outside [0, P), G not divisible by P, fewer than G
    examples with drop_last=True, a source that is not one, or an item unlike item 0 (when read).
    """
    it = BatchIterator(as_source(dataset), global_batch_size, seed=seed, drop_last=drop_last,
                       process_index=process_index, num_processes=num_processes, prefetch=prefetch, threads=threads,
                       workers=workers, order=order, transform=transform)
    if start_state is not None:
        it.set_state(start_state)
    return it
