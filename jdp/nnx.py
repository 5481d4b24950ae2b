"""Your own Flax NNX model through jdp: a data-parallel step from an `nnx.Module` and a loss

The public name of `jdp.bridges.nnx`, where it is implemented; import it as `jdp.nnx`.
"""
from jdp.bridges.nnx import (NnxTrainStep, SplitModel, make_train_step, task, update_model)

__all__ = ["NnxTrainStep", "SplitModel", "make_train_step", "task", "update_model"]
