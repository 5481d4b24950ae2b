"""The optimizer state sharded over the data-parallel devices (ZeRO stage 1), the same step.

The public name of `jdp.core.zero`, where it is implemented; import it as `jdp.zero`.
"""
from jdp.core.zero import Cuts, ShardedStateLayout, clip_by_global_norm, split_dim

__all__ = ["Cuts", "ShardedStateLayout", "clip_by_global_norm", "split_dim"]
