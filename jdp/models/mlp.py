"""A multilayer perceptron (Flax NNX)."""
from __future__ import annotations

from collections.abc import Sequence

import jax
from flax import nnx


class MLP(nnx.Module):
    """Dense layers with ReLU between them: (batch, sizes[0]) -> (batch, sizes[-1]) logits."""

    def __init__(self, sizes: Sequence[int], *, rngs: nnx.Rngs):
        if len(sizes) < 2 or any(int(s) < 1 for s in sizes):
            raise ValueError(f"sizes={list(sizes)} must list at least two positive layer widths.")
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in zip(sizes[:-1], sizes[1:])])

    def __call__(self, x: jax.Array, *, train: bool = True) -> jax.Array:
        """(batch, ...) -> (batch, sizes[-1]); `train` is accepted for the models' common interface."""
        del train  # no dropout or normalisation: train and eval are the same function
        x = x.reshape(x.shape[0], -1)
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = nnx.relu(x)
        return x
