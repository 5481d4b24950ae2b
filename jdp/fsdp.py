"""Params, gradient and optimizer state sharded over the data-parallel devices (FSDP, ZeRO stage 3), the same step.

The public name of `jdp.core.fsdp`, where it is implemented; import it as `jdp.fsdp`.
"""
from jdp.bridges.gathered import gathered
from jdp.core.fsdp import FullyShardedLayout, host_whole, whole_params
from jdp.core.split import Split, gather, gather_layer_axis, is_split

__all__ = ["FullyShardedLayout", "Split", "gather", "gather_layer_axis", "gathered", "host_whole", "is_split",
           "whole_params"]
