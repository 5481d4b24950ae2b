"""`make_train_step`: a data-parallel step on N devices that equals one device on the global batch.

The public name of `jdp.core.step`, where it is implemented; import it as `jdp.step`.
"""
from jdp.core.placement import check_batch
from jdp.core.step import (TrainStep, check_state, check_trainable, get_params, get_tree, make_train_step,
                           step_optimizer)

__all__ = ["TrainStep", "check_batch", "check_state", "check_trainable", "get_params", "get_tree", "make_train_step",
           "step_optimizer"]
