"""The input pipeline: sources of examples, the epoch order, and sharded, resumable global batches.

- Sources (one module each): in-memory arrays (`arrays`: `ArrayDataset`, `load_arrays`), any
  random-access object such as a `grain.MapDataset` (`sources`: `ItemSource`, `as_source`),
  token files read window by window (`tokens`: `load_tokens`), ArrayRecord files (`array_record`:
  `load_array_record`), and the datasets jdp ships (`datasets`: digits, a character corpus,
  the seed regressions; nothing downloads).
- `order`: the order an epoch visits n examples in, a function of (seed, epoch, n).
- `batches`: `make_batches`, this process's slice of each global batch, the same whatever the
  device or process count, resumable mid-epoch with `get_state` / `set_state`.

A new kind of source is one module with a class offering `__len__`, `__getitem__`, `take`,
`spec` and `digest` (see `jdp.data.sources`). grain is imported only once batches are read.
"""
from jdp.data.array_record import (ArrayRecordSource, decode_example, encode_example, load_array_record,
                                   write_array_record)
from jdp.data.arrays import ArrayDataset, as_dataset, load_arrays
from jdp.data.batches import MASK_KEY, BatchIterator, example_rng, make_batches
from jdp.data.datasets import (DIGITS_EXAMPLES, SEED_REGRESSIONS, CharCorpus, SeedRegression, char_windows,
                               held_out_count, load_char_corpus, load_digits, load_seed_regression)
from jdp.data.order import ORDERS, epoch_order, shuffled_positions
from jdp.data.sources import ItemSource, as_source
from jdp.data.tokens import TOKEN_DTYPES, TokenWindows, load_tokens

__all__ = ["ArrayDataset", "ArrayRecordSource", "BatchIterator", "CharCorpus", "DIGITS_EXAMPLES", "ItemSource", "MASK_KEY", "ORDERS",
           "SEED_REGRESSIONS", "SeedRegression", "TOKEN_DTYPES", "TokenWindows", "as_dataset", "as_source",
           "char_windows", "decode_example", "encode_example", "epoch_order", "example_rng", "held_out_count",
           "load_array_record", "load_arrays", "load_char_corpus", "load_digits", "load_seed_regression",
           "load_tokens", "make_batches", "shuffled_positions", "write_array_record"]
