"""Your Flax Linen `TrainState` through jdp: a data-parallel step that continues it, and the way back.

For code written around `flax.training.train_state.TrainState` (`TrainState.create(apply_fn=
model.apply, params=params, tx=tx)`, a loss that calls `state.apply_fn({'params': params}, x)`):

    step, state = jdp.linen.make_train_step(train_state, loss_fn)   # loss_fn(params, batch), one device's
    for batch in batches:                                           # global batches
        state, metrics = step(state, batch)
    train_state = jdp.linen.to_train_state(train_state, state)      # continue on one device

The step is `jdp.make_train_step(loss_fn, train_state.tx, **options)`; its state starts from the
TrainState's params and continues its optimizer state and step count, so N devices take the steps
the one-device `train_state.apply_gradients` loop would have taken next on the same global batches.

Flax's ImageNet pattern (a TrainState subclass with `batch_stats`, `nn.BatchNorm(axis_name='batch')`)
runs as it is written: the `batch_stats` field is the model state, and `axis_name='batch'` makes jdp
bind the axis the model reduces over:

    def loss_fn(params, batch_stats, batch):
        logits, new_model_state = state.apply_fn({'params': params, 'batch_stats': batch_stats},
                                                 batch['image'], mutable=['batch_stats'])
        return cross_entropy_loss(logits, batch['label']), new_model_state['batch_stats']

    step, jstate = jdp.linen.make_train_step(state, loss_fn, axis_name='batch')
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state as flax_train_state

from jdp.core.annotations import reboxed_linen, unboxed_linen
from jdp.core.loss import signature_mismatch
from jdp.core.state import LocalAccum, TrainState
from jdp.core.step import TrainStep, get_tree
from jdp.core.step import make_train_step as make_array_step


def make_train_step(train_state: flax_train_state.TrainState, loss_fn: Callable, *, model_state=None,
                    seed: int = 0, **options) -> tuple[TrainStep, TrainState]:
    """A data-parallel step for `train_state`'s optimizer, and a jdp state that continues `train_state`.

    Args:
      train_state: a `flax.training.train_state.TrainState` (or a subclass); read, never modified.
        Its `tx` is the optimizer; its `params`, `opt_state` and `step` are where training continues.
        A subclass with a `batch_stats` field (Flax's ImageNet example) carries it as the model
        state: has_state is then on, and `loss_fn` takes and returns the statistics. A
        `dynamic_scale` field must be None (jdp has no fp16 loss scaling; bf16 needs none).
      loss_fn: the loss written for one device, e.g. around `train_state.apply_fn`:
        `loss_fn(params, batch) -> loss`, the MEAN over the examples it is given;
        `(params, batch_stats, batch) -> (loss, new_batch_stats)` with model state, where
        `new_batch_stats` is `new_model_state['batch_stats']` of `apply(..., mutable=['batch_stats'])`
        (the statistics themselves, not the dict around them); `(loss, aux)` /
        `(loss, (aux, new_batch_stats))` with has_aux; a last `rng` argument with needs_rng. See
        `jdp.make_train_step`.
      model_state: the initial non-parameter state, when it is not a `batch_stats` field of
        `train_state` (then pass has_state=True too); default: `train_state.batch_stats` if present.
      seed: the base key of `needs_rng`'s per-device, per-step keys.
      **options: those of `jdp.make_train_step` (backend, devices, accum_steps, accum_sync,
        has_aux, needs_rng, has_state, skip_nonfinite, grad_norm, mask_key, axis_name: e.g.
        'batch' for a model whose BatchNorm has axis_name='batch', sync_batchnorm). reduction='sum'
        is refused: the continued optimizer state holds statistics of mean gradients.
        `mesh=` (backend="jit" only): the `jax.sharding.Mesh` the code was written for, e.g.
        nanodo's `Mesh(devices, ("data",))`: the step runs on it, the batch split over its data
        axis, and the annotations' names that are its axes map to themselves.

    Params boxed by `nn.with_partitioning` / `nn.with_logical_partitioning` (`nn.Partitioned`
    leaves, and the optimizer state that mirrors them): the step takes their values, and the boxes'
    names as the params' annotations (honoured under backend="jit", set aside under "shard_map" and
    "pmap", where a model whose code constrains shardings while it runs is refused in one sentence);
    `to_train_state` puts the trained values back into the same boxes.

    Returns:
      `(step, state)`: a `jdp.TrainStep` and its state, `state, metrics = step(state, batch)`.
    """
    _check_train_state(train_state)
    # nn.with_partitioning / nn.with_logical_partitioning box the params (and optax's state mirrors
    # them): the step takes the values, and the boxes' axis names as the params' annotations
    params, annotations = unboxed_linen(train_state.params)
    if annotations is not None:
        train_state = train_state.replace(params=params, opt_state=unboxed_linen(train_state.opt_state)[0])
        options = {"param_axes": annotations, **options}
    if options.get("reduction", "mean") != "mean":
        raise ValueError(f"jdp.linen continues train_state.opt_state, whose statistics are of mean gradients, so it "
                         f"needs reduction='mean'; reduction={options['reduction']!r} would feed that state N× "
                         f"gradients (lr_correction only rescales the update).")
    model_state, options = _model_state(train_state, model_state, options)
    _check_arity(loss_fn, 2 + bool(options.get("needs_rng")) + bool(options.get("has_state")), options)
    _check_opt_state(train_state)
    step = make_array_step(loss_fn, train_state.tx, **options)
    fresh = step.init(train_state.params, model_state, seed=seed)
    count = jnp.asarray(train_state.step, jnp.int32)
    canonical = step.canonical(fresh)
    opt_state = train_state.opt_state
    if step.options.multi_steps:
        # accum_sync="every" wrapped tx in optax.MultiSteps: the TrainState's state is its inner one.
        opt_state = canonical.opt_state._replace(inner_opt_state=opt_state, gradient_step=count)
    canonical = canonical.replace(step=count, micro_step=count * step.options.accum_steps, opt_state=opt_state)
    return step, step.place(canonical, fresh)


def _model_state(train_state, model_state, options: dict) -> tuple[object, dict]:
    """The initial model state and the options with has_state resolved: a `batch_stats` field
    turns it on; an explicit `model_state` needs has_state=True; dynamic_scale is refused."""
    if getattr(train_state, "dynamic_scale", None) is not None:
        raise ValueError("train_state.dynamic_scale is set, but jdp has no fp16 loss scaling (bfloat16, "
                         "precision='bf16', has float32's range and needs none): create the TrainState with "
                         "dynamic_scale=None.")
    stats = getattr(train_state, "batch_stats", None)
    has_field = _has_batch_stats(train_state)
    if model_state is None and has_field and jax.tree.leaves(stats):
        if options.get("has_state") is False:
            raise ValueError("train_state has batch_stats, which a BatchNorm updates on every step: drop "
                             "has_state=False, and let loss_fn take and return them, "
                             "loss_fn(params, batch_stats, batch) -> (loss, new_batch_stats).")
        return stats, {**options, "has_state": True}
    if options.get("has_state") and (model_state is None or not jax.tree.leaves(model_state)):
        raise ValueError("has_state=True needs the model state the loss takes: pass model_state=... (e.g. "
                         "variables['batch_stats']), or a TrainState subclass with a batch_stats field.")
    return (() if model_state is None else model_state), options


def _has_batch_stats(train_state) -> bool:
    return "batch_stats" in {f.name for f in dataclasses.fields(train_state)}


def to_train_state(train_state: flax_train_state.TrainState, state: TrainState) -> flax_train_state.TrainState:
    """`train_state` with the trained params, optimizer state, step count and (a `batch_stats`
    field) BatchNorm statistics of jdp's `state`.

    The values are host numpy arrays (one copy, original shapes and dtypes; `step` keeps the type
    `train_state.step` has), so one-device code, e.g. `train_state.apply_gradients`, continues
    from exactly where the data-parallel steps left off. Params boxed by `nn.with_partitioning` /
    `nn.with_logical_partitioning` (and the optimizer state that mirrors them) come back in the same
    boxes, with the same metadata, as `train_state` holds them. Take it after an update (with
    accum_steps = M: after the M-th call of an optimizer step), since a partial step's gradient
    sums are not part of a TrainState.
    """
    _check_train_state(train_state)
    if not isinstance(state, TrainState):
        raise ValueError(f"state must be the jdp state from jdp.bridges.linen.make_train_step, got {type(state).__name__}.")
    boxed = train_state
    if unboxed_linen(train_state.params)[1] is not None:  # the step took the values out of the boxes
        train_state = train_state.replace(params=unboxed_linen(train_state.params)[0],
                                          opt_state=unboxed_linen(train_state.opt_state)[0])
    if not state.stacked and not all(x.sharding.is_fully_replicated for x in jax.tree.leaves((state.params,
                                     state.opt_state)) if isinstance(x, jax.Array)):
        raise ValueError("state's optimizer state is sharded over the devices (shard_optimizer_state or shard_params "
                         "True); pass train_step.canonical(state), which gathers it into the params' shapes.")
    opt_state = get_tree(state, state.opt_state)
    want = jax.tree.structure(jax.eval_shape(train_state.tx.init, train_state.params))
    if jax.tree.structure(opt_state) != want and isinstance(opt_state, optax.MultiStepsState):
        if int(opt_state.mini_step):
            raise ValueError(f"state is in the middle of an optimizer step ({int(opt_state.mini_step)} micro-batches "
                             f"accumulated); call to_train_state after the step's last micro-batch.")
        opt_state = opt_state.inner_opt_state  # accum_sync="every" wrapped tx in optax.MultiSteps
    if jax.tree.structure(opt_state) != want:
        raise ValueError("state's optimizer state does not have the structure train_state.tx.init gives; pass the "
                         "TrainState the step was made from.")
    if isinstance(state.accum, LocalAccum) and state.accum.grads is not None and np.any(
            np.asarray(jax.device_get(state.accum.weight))):
        raise ValueError("state is in the middle of an optimizer step (accum_sync='last' holds gradient sums); call "
                         "to_train_state after the step's last micro-batch.")
    step = get_tree(state, state.step)
    step = int(step) if isinstance(train_state.step, int) else np.asarray(step, np.asarray(train_state.step).dtype)
    trained = {"step": step, "params": get_tree(state, state.params), "opt_state": opt_state}
    if _has_batch_stats(train_state) and jax.tree.leaves(state.model_state):
        trained["batch_stats"] = get_tree(state, state.model_state)
    if boxed is not train_state:
        trained["params"] = reboxed_linen(boxed.params, trained["params"])
        trained["opt_state"] = reboxed_linen(boxed.opt_state, trained["opt_state"])
    return boxed.replace(**trained)


def _check_train_state(train_state) -> None:
    if not isinstance(train_state, flax_train_state.TrainState):
        raise ValueError(f"train_state must be a flax.training.train_state.TrainState (TrainState.create(apply_fn=..., "
                         f"params=..., tx=...)), got {type(train_state).__name__}.")


def _check_opt_state(train_state) -> None:
    """The TrainState's optimizer state must be what its tx makes for its params (structure, shapes, dtypes)."""
    want = jax.eval_shape(train_state.tx.init, train_state.params)
    have = train_state.opt_state
    shape = lambda x: (np.shape(x), jnp.result_type(x))  # noqa: E731
    if (jax.tree.structure(have) != jax.tree.structure(want)
            or [shape(x) for x in jax.tree.leaves(have)] != [(x.shape, x.dtype) for x in jax.tree.leaves(want)]):
        raise ValueError("train_state.opt_state is not the state train_state.tx makes for train_state.params "
                         "(different structure, shapes or dtypes); build it with TrainState.create.")


def _check_arity(loss_fn: Callable, n: int, options: dict) -> None:
    if not callable(loss_fn):
        raise ValueError(f"loss_fn must be callable, got {type(loss_fn).__name__}.")
    names = ["params", *(["model_state"] if options.get("has_state") else []), "batch",
             *(["rng"] if options.get("needs_rng") else [])]
    mismatch = signature_mismatch(loss_fn, names, bool(options.get("needs_rng")), "a jax.random key",
                                  bool(options.get("has_state")))
    if mismatch:
        raise ValueError(mismatch)


__all__ = ["make_train_step", "to_train_state"]
