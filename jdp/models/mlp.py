"""A multilayer perceptron (Flax NNX)."""
from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jdp.models.dtypes import compute_dtype


class MLP(nnx.Module):
    """Dense layers with ReLU between them: (batch, sizes[0]) -> (batch, sizes[-1]) logits.

    Params float32; compute in `dtype` (None: float32; jnp.bfloat16 / "bf16": bfloat16 matmuls);
    logits float32, so the softmax / cross-entropy a loss builds on them is float32.
    """

    def __init__(self, sizes: Sequence[int], *, dtype=None, rngs: nnx.Rngs):
        if len(sizes) < 2 or any(int(s) < 1 for s in sizes):
            raise ValueError(f"sizes={list(sizes)} must list at least two positive layer widths.")
        dtype = compute_dtype(dtype)
        self.layers = nnx.List([nnx.Linear(a, b, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
                                for a, b in zip(sizes[:-1], sizes[1:])])

    def __call__(self, x: jax.Array, *, train: bool = True) -> jax.Array:
        """(batch, ...) float -> (batch, sizes[-1]) float32; `train` is accepted for the models' common interface."""
        del train  # no dropout or normalisation: train and eval are the same function
        x = x.reshape(x.shape[0], -1)
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = nnx.relu(x)
        return x.astype(jnp.float32)
