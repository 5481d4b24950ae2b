"""Params, gradient and optimizer state sharded over the data-parallel devices (FSDP, ZeRO stage 3), the same step.

The public name of `jdp.core.fsdp`, where it is implemented; import it as `jdp.fsdp`.
"""
from jdp.core.fsdp import FullyShardedLayout, host_whole, whole_params

__all__ = ["FullyShardedLayout", "host_whole", "whole_params"]
