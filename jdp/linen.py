"""Your Flax Linen `TrainState` through jdp: a data-parallel step that continues it, and the way back.

The public name of `jdp.bridges.linen`, where it is implemented; import it as `jdp.linen`.
"""
from jdp.bridges.linen import (make_train_step, to_train_state)

__all__ = ["make_train_step", "to_train_state"]
