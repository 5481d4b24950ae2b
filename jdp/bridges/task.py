"""`Task`: a model and its data in the form the trainer consumes (`jdp.train.train(..., task=...)`).

The trainer builds one from a config (`jdp.run.tasks.build_task`); `jdp.nnx.task` builds one from
your own NNX model, loss and arrays.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Task:
    """A model and its data, in the form the step and the loop consume."""

    params: Any  # initial params (identical on every host: one seed)
    model_state: Any  # non-parameter state (BatchNorm statistics), () if none
    loss_fn: Callable  # loss_fn(params, model_state, batch, rng) -> (loss, (aux, new_model_state))
    metric_fn: Callable  # metric_fn(params, model_state, batch) -> {name: per-example values}
    train: Any  # a jdp.data source (ArrayDataset, TokenWindows, ItemSource over a grain.MapDataset, ...)
    test: Any  # a source evaluated at eval steps; None: no held-out set
    description: str
    sync_batchnorm: bool = True  # False: the model keeps per-device statistics (the step's sync_batchnorm)
    transform: Callable | None = None  # transform(example, rng) on every training example (jdp.data.make_batches)
    per_token: bool = False  # a language model: the loss is a mean per token, evaluated with perplexity too
    bytes_per_token: float | None = None  # UTF-8 bytes of text per held-out token (bits per byte); None: unknown
    flops_per_example: float | None = None  # model FLOPs of one example's training step by the model's own
    #                                         count (jdp's GPT: 6N+12LHQT per token); None: counted from the program
    flops_source: str | None = None  # which count flops_per_example is (`jdp.inspect.flops.GPT_SOURCE`)


__all__ = ["Task"]
