"""Checking a converted state dict against a model: the one helper the nanoGPT and Hugging Face imports share."""
from __future__ import annotations

import numpy as np
from flax import nnx


def flat_items(tree, prefix=()):
    """(path, leaf) pairs of a nested dict."""
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from flat_items(value, prefix + (key,))
        else:
            yield prefix + (key,), value


def shape_mismatches(model: nnx.Module, params: dict) -> list[str]:
    """Every param path whose shape in `params` differs from `model`'s ("path: got for expected"), sorted;
    a path missing on either side shows as shape ()."""
    expected = dict(flat_items(nnx.to_pure_dict(nnx.state(model, nnx.Param))))
    got = dict(flat_items(params))
    return sorted(f"{'.'.join(map(str, k))}: {np.shape(got.get(k))} for {np.shape(expected.get(k))}"
                  for k in set(expected) | set(got) if np.shape(got.get(k)) != np.shape(expected.get(k)))
