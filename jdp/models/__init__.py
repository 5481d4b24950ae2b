"""Flax NNX models, and the bridge from an `nnx.Module` to jdp's `(params, loss_fn)` form."""
from jdp.models.mlp import MLP
from jdp.models.nnx_bridge import FunctionalModel, functional

__all__ = ["MLP", "FunctionalModel", "functional"]
