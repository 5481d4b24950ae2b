"""Converted weights into a model: the helpers every checkpoint reader (GPT-2, Llama, nanoGPT) shares."""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def flat_items(tree, prefix=()):
    """(path, leaf) pairs of a nested dict."""
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from flat_items(value, prefix + (key,))
        else:
            yield prefix + (key,), value


def _shape(x) -> tuple:
    return tuple(x.shape) if hasattr(x, "shape") else np.shape(x)


def shape_mismatches(model: nnx.Module, params: dict) -> list[str]:
    """Every param path whose shape in `params` differs from `model`'s ("path: got for expected"), sorted;
    a path missing on either side shows as shape (). `model` may be abstract (`build_model`)."""
    expected = dict(flat_items(nnx.to_pure_dict(nnx.state(model, nnx.Param))))
    got = dict(flat_items(params))
    return sorted(f"{'.'.join(map(str, k))}: {_shape(got.get(k))} for {_shape(expected.get(k))}"
                  for k in set(expected) | set(got) if _shape(got.get(k)) != _shape(expected.get(k)))


def build_model(make: Callable[[nnx.Rngs], nnx.Module]) -> nnx.Module:
    """`make(rngs)`'s module with abstract params (shapes and dtypes, no arrays): nothing is initialised,
    so a reader that fills it (`install_params`) never holds a random model beside the checkpoint's."""
    return nnx.eval_shape(lambda: make(nnx.Rngs(0)))


def stack_layers(params: dict, n_layers: int) -> dict:
    """Unscanned `params` (a "blocks" dict {0: layer, 1: ...}) with the blocks stacked along a new leading
    axis as "layers", layer i at index i, as a scanned model holds them."""
    blocks = params.pop("blocks")
    params["layers"] = jax.tree.map(lambda *layers: np.stack(layers), *(blocks[i] for i in range(n_layers)))
    return params


def _to_device(tree: dict) -> dict:
    """`tree`'s numpy leaves as jax arrays, each dropped from `tree` once copied: at most one leaf is held twice."""
    out = {}
    for key in list(tree):
        value = tree.pop(key)
        out[key] = _to_device(value) if isinstance(value, dict) else jnp.asarray(value)
    return out


def install_params(model: nnx.Module, params: dict, where: str) -> nnx.Module:
    """`model` (abstract or not) holding the unscanned `params` (stacked along a leading layer axis if the
    model scans its layers), float32 jax arrays. ValueError naming every array whose shape differs."""
    if getattr(model, "scan_layers", False):
        params = stack_layers(params, model.n_layers)
    wrong = shape_mismatches(model, params)
    if wrong:
        raise ValueError(f"{where}: the weights' shapes do not match config.json's sizes (weights for "
                         f"{type(model).__name__}): {wrong[:5]}.")
    nnx.update(model, _to_device(params))  # every abstract leaf replaced: the shapes matched, path by path
    return model


__all__ = ["build_model", "flat_items", "install_params", "shape_mismatches", "stack_layers"]
