"""Your own Flax NNX model through jdp: a data-parallel step from an `nnx.Module` and a loss
written for one device, as in Flax's tutorials.

    step = jdp.nnx.make_train_step(model, loss_fn, optax.adamw(5e-3), has_aux=True)
    state = step.init(seed=0)
    for batch in batches:                  # global batches
        state, metrics = step(state, batch)
    jdp.nnx.update_model(model, state)     # trained params and BatchNorm statistics into `model`

Inside the step, each device merges a private copy of the model from the replicated params and
non-parameter state (BatchNorm statistics), calls `loss_fn(model, batch)` on its b examples, and
splits the copy again to read the statistics the call wrote. The user's `model` is never changed
by the step: only `update_model` writes into it.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

from jdp.bridges.task import Task
from jdp.core.loss import signature_mismatch
from jdp.core.mesh import DATA_AXIS, device_axes
from jdp.core.state import TrainState
from jdp.core.weighting import is_weighted
from jdp.core.step import TrainStep, get_tree
from jdp.core.step import make_train_step as make_array_step


@dataclass(frozen=True)
class SplitModel:
    """jdp's copy of a model, split: what it differentiates, carries and reseeds, per mode."""

    graphdef: Any  # train mode, BatchNorm axis_name set if synchronised
    eval_graphdef: Any  # the same model after `.eval()`: running averages, no dropout
    params: Any  # nnx.State of the nnx.Param variables
    rng_state: Any  # stored nnx.Rngs streams: reseeded on every call, never carried
    rest: Any  # every other variable (BatchNorm statistics): jdp's model_state
    streams: tuple[str, ...]  # the tags of the stored rng streams
    annotations: Any = None  # the params' sharding annotations (`nnx.with_partitioning`), None if there are none

    @classmethod
    def of(cls, model: nnx.Module, sync_batchnorm: bool, axis_name: str | tuple = DATA_AXIS) -> SplitModel:
        if not isinstance(model, nnx.Module):
            raise ValueError(f"model must be an nnx.Module, got {type(model).__name__}; for Linen, see "
                             f"jdp.linen.make_train_step.")
        copy = nnx.clone(model)
        annotations = param_annotations(copy)
        if sync_batchnorm:
            for _, module in nnx.iter_modules(copy):
                if isinstance(module, nnx.BatchNorm):
                    module.axis_name = axis_name
        graphdef, params, rng_state, rest = nnx.split(copy, nnx.Param, nnx.RngState, ...)
        streams = tuple(sorted({n.tag for _, n in nnx.iter_graph(copy) if isinstance(n, nnx.RngStream)}))
        copy.eval()
        return cls(graphdef, nnx.split(copy, nnx.Param, nnx.RngState, ...)[0], params, rng_state, rest, streams,
                   annotations)

    def metric_adapter(self, metric_fn: Callable) -> Callable:
        """`metric_fn(model, batch)` as jdp's `(params, model_state, batch)`, the model in eval mode."""
        return lambda params, rest, batch: metric_fn(nnx.merge(self.eval_graphdef, params, self.rng_state, rest,
                                                               copy=True), batch)


class NnxTrainStep:
    """A `jdp.TrainStep` for an nnx model: `init(seed)` takes the model's own params and state.

    Everything else (calling it, `lower`, `shard_batch`, `micro_batches`, `mesh`, ...) is the
    wrapped `TrainStep`'s, so `jdp.get_params`, `jdp.check_replicas` and `jdp.comm_report` work as
    for any step.
    """

    def __init__(self, step: TrainStep, model: SplitModel):
        self.step, self.model = step, model

    def init(self, seed: int = 0) -> TrainState:
        """The initial state: the model's params, non-parameter state and a fresh optimizer state.

        `seed` fixes the keys of `needs_rng` and of any `nnx.Rngs` stored in the model: each
        device and micro-step derives its own from it.
        """
        return self.step.init(self.model.params, self.model.rest, seed=seed)

    def __call__(self, state: TrainState, batch):
        """One call on a global (micro-)batch; see `jdp.TrainStep.__call__`."""
        return self.step(state, batch)

    def evaluate(self, state: TrainState, metric_fn: Callable, data, batch_size: int = 256) -> dict[str, float]:
        """Exact means of `metric_fn(model, batch) -> {name: per-example values (b,)}` over all of `data`.

        `model` is the state's model in eval mode (`model.eval()`: BatchNorm's running averages,
        no dropout); data-parallel, the last batch padded and masked, as `jdp.TrainStep.evaluate`.
        """
        return self.step.evaluate(state, self._eval_adapter(metric_fn), data, batch_size)

    @functools.lru_cache(maxsize=8)  # one adapter (so one compiled evaluation) per metric_fn
    def _eval_adapter(self, metric_fn):
        return self.model.metric_adapter(metric_fn)

    def __getattr__(self, name):
        return getattr(self.step, name)


def make_train_step(model: nnx.Module, loss_fn: Callable, optimizer, *, sync_batchnorm: bool = True,
                    has_aux: bool = False, needs_rng: bool = False, **options) -> NnxTrainStep:
    """A data-parallel step that trains `model` with `loss_fn`, equal to one device's step on the global batch.

    Args:
      model: any `nnx.Module` (BatchNorm, Dropout and stored `nnx.Rngs` included); read once,
        never modified.
      loss_fn: `loss_fn(model, batch) -> loss`, the MEAN loss over the examples it is given, written
        for one device; `(loss, aux)` with has_aux (aux: scalars such as accuracy, averaged over
        devices); `loss_fn(model, batch, rngs)` with needs_rng, where `rngs` is an `nnx.Rngs` with
        one stream, "default" (any other name falls back to it), keyed
        `fold_in(fold_in(key(seed), micro_step), device)`: micro_step counts the step's calls,
        device is this device's index. The model's stored Rngs streams are reseeded from that
        key on every call, needs_rng or not (the i-th by sorted name with `fold_in(key, i)`).
      optimizer: an optax transformation, a `jdp.OptimizerSpec`, or an `nnx.Optimizer` built for
        `model` (its `tx` is used; its state is not: `init` starts a fresh one).
      sync_batchnorm: every `nnx.BatchNorm` computes its batch statistics over the global batch
        (`axis_name` set on jdp's copy of the model, not on `model`), so the step equals one
        device's. False keeps each device's own statistics, as PyTorch DDP without SyncBatchNorm:
        NOT equal to one device.
      **options: those of `jdp.make_train_step` (backend, reduction, lr_correction, devices,
        accum_steps, accum_sync, skip_nonfinite, grad_norm, mask_key, axis_name: the mesh axis
        that jdp binds and sets as every BatchNorm's axis_name; with replicas > 1, both of hybrid
        sharding's axes).

    Returns:
      An `NnxTrainStep`: `state = step.init(seed=0)`, `state, metrics = step(state, batch)`.
      `jdp.get_params(state)` is an `nnx.State` of the model's `nnx.Param` variables only,
      host numpy arrays in their own shapes (`state.model_state` holds BatchNorm's statistics).
    """
    # backend="jit": the loss sees the global batch, so a BatchNorm's statistics are the global batch's
    # without an axis name (and under jit no axis is bound to name)
    split = SplitModel.of(model, sync_batchnorm and options.get("backend") != "jit", device_axes(options.get("axis_name", DATA_AXIS),
                                                              options.get("replicas", 1)))
    _check_arity(loss_fn, needs_rng)
    for name in ("has_state", "needs_rng", "has_aux"):
        if name in options:
            raise ValueError(f"{name} is set by jdp.nnx.make_train_step from the model; do not pass it.")
    tx = _transformation(optimizer, split.params)
    device_loss = _device_loss(split, loss_fn, has_aux=has_aux, needs_rng=needs_rng)
    step = make_array_step(device_loss, tx, has_aux=has_aux, has_state=True, needs_rng=True,
                           sync_batchnorm=sync_batchnorm, param_axes=split.annotations, **options)
    return NnxTrainStep(step, split)


def task(model: nnx.Module, loss_fn: Callable, metric_fn: Callable, train, test=None, *, has_aux: bool = False,
         needs_rng: bool = False, sync_batchnorm: bool = True, description: str | None = None,
         transform: Callable | None = None) -> Task:
    """Your model, loss and arrays as a `jdp.bridges.task.Task`, for the full trainer:
    `jdp.train.train(config, workdir, task=jdp.nnx.task(...))` (checkpoints, exact resume, metrics,
    evaluation, multi-process). The config's model and data names are then not used.

    `loss_fn` as for `make_train_step`; with `data.drop_last: false` batches carry a "mask" (1 real,
    0 padding) and the loss must be `sum(mask · per-example loss) / b` (the trainer's step divides by
    the real count), or `jdp.Weighted(sum(mask · l), sum(mask))`, e.g. per token. `metric_fn(model,
    batch) -> {name: per-example values, or jdp.Weighted of per-token ones}` on the model in eval mode. `train`/`test`: dicts of arrays with one
    leading axis, or any source `jdp.data.make_batches` takes (a `grain.MapDataset`, an object with
    `__len__` and `__getitem__(i) -> {key: array}`, `jdp.data.load_tokens(...)`,
    `jdp.data.load_array_record(...)`). `transform(example, rng) -> example` runs on every training
    example as it is read, `rng` seeded from (train.seed, epoch, index); evaluation reads `test` as is.
    """
    from jdp.data import as_source  # the trainer's pipeline: not needed for a step alone

    split = SplitModel.of(model, sync_batchnorm)
    _check_arity(loss_fn, needs_rng)
    inner = _device_loss(split, loss_fn, has_aux=has_aux, needs_rng=needs_rng)
    trainer_loss = inner if has_aux else lambda *args: (lambda out: (out[0], ({}, out[1])))(inner(*args))
    return Task(split.params, split.rest, trainer_loss, split.metric_adapter(metric_fn), as_source(train),
                None if test is None else as_source(test), description or f"{type(model).__name__} (your model)",
                sync_batchnorm, transform)


def _device_loss(split: SplitModel, loss_fn, *, has_aux: bool, needs_rng: bool):
    """jdp's `(params, rest, batch, key) -> (loss, (aux, new_rest))` around a loss over a model."""

    def device_loss(params, rest, batch, key):
        model = nnx.merge(split.graphdef, params, split.rng_state, rest, copy=True)
        if split.streams:  # stored nnx.Rngs: one key per stream from this device's key
            nnx.reseed(model, **{s: jax.random.fold_in(key, i) for i, s in enumerate(split.streams)})
        out = loss_fn(model, batch, nnx.Rngs(key)) if needs_rng else loss_fn(model, batch)
        if has_aux and (not (isinstance(out, tuple) and len(out) == 2) or is_weighted(out)):
            raise ValueError(f"loss_fn must return (loss, aux) with has_aux=True, got {type(out).__name__}.")
        loss, aux = out if has_aux else (out, {})
        new_rest = nnx.split(model, nnx.Param, nnx.RngState, ...)[3]
        return (loss, (aux, new_rest)) if has_aux else (loss, new_rest)

    return device_loss


def param_annotations(model: nnx.Module):
    """The sharding annotations of `model`'s params (`nnx.with_partitioning`: each Param's
    `out_sharding`), as a tree like its Param state, or None if it has none. The step honours them
    under backend="jit" and sets them aside under the others (`jdp.core.annotations`)."""
    params = nnx.state(model, nnx.Param)
    found = jax.tree.map(lambda v: v.get_metadata().get("out_sharding"), params,
                         is_leaf=lambda x: isinstance(x, nnx.Variable))
    return found if any(x is not None for x in jax.tree.leaves(found, is_leaf=lambda x: x is None)) else None


def _check_arity(fn: Callable, needs_rng: bool) -> None:
    if not callable(fn):
        raise ValueError(f"loss_fn must be callable, got {type(fn).__name__}.")
    names = ["model", "batch", *(["rngs"] if needs_rng else [])]
    mismatch = signature_mismatch(fn, names, needs_rng, "an nnx.Rngs")
    if mismatch:
        raise ValueError(mismatch)


def _transformation(optimizer, params):
    """`optimizer` as jdp.make_train_step takes it; an nnx.Optimizer must have been built for these params."""
    if not isinstance(optimizer, nnx.Optimizer):
        return optimizer
    want = [np.shape(x) for x in jax.tree.leaves(jax.eval_shape(optimizer.tx.init, params))]
    have = [np.shape(x) for x in jax.tree.leaves(optimizer.opt_state)]
    if want != have:
        raise ValueError(f"the nnx.Optimizer was built for another model: its state has {len(have)} arrays "
                         f"shaped {have[:3]}..., this model's needs {len(want)} shaped {want[:3]}....")
    return optimizer.tx


def update_model(model: nnx.Module, state: TrainState, optimizer: nnx.Optimizer | None = None) -> None:
    """Write the trained params and non-parameter state (BatchNorm statistics) of `state` into `model`.

    With `optimizer` (an `nnx.Optimizer` for `model` with the same optax transformation), its
    state and step count are set too, so a one-device `nnx.Optimizer` loop can continue. A step
    made with shard_optimizer_state=True keeps its optimizer state in slices: pass
    `train_step.canonical(state)`, which gathers it into the params' shapes.
    """
    if not isinstance(model, nnx.Module):
        raise ValueError(f"model must be an nnx.Module, got {type(model).__name__}.")
    if optimizer is not None and not state.stacked and not all(
            x.sharding.is_fully_replicated for x in jax.tree.leaves(state.opt_state) if isinstance(x, jax.Array)):
        raise ValueError("state's optimizer state is sharded over the devices (shard_optimizer_state=True); pass "
                         "train_step.canonical(state), which gathers it into the params' shapes.")
    nnx.update(model, get_tree(state, state.params), get_tree(state, state.model_state))
    if optimizer is None:
        return
    opt_state = get_tree(state, state.opt_state)
    if isinstance(opt_state, optax.MultiStepsState):  # accum_sync="every" wrapped the optimizer
        opt_state = opt_state.inner_opt_state
    values = jax.tree.leaves(opt_state)
    variables = jax.tree.leaves(optimizer.opt_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    if [np.shape(v) for v in values] != [np.shape(v.get_value()) for v in variables]:
        raise ValueError("optimizer's state does not match the step's: build the nnx.Optimizer with the same "
                         "model and optax transformation (lr_correction='auto' and 'exact' change it).")
    for variable, value in zip(variables, values):
        variable.set_value(value)
    optimizer.step.set_value(np.asarray(get_tree(state, state.step), np.uint32))


__all__ = ["NnxTrainStep", "SplitModel", "make_train_step", "task", "update_model"]
