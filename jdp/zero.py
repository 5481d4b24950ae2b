"""The optimizer state sharded over the data-parallel devices (ZeRO stage 1), the same step.

The public name of `jdp.core.zero`, where it is implemented; import it as `jdp.zero`.
"""
from jdp.core.zero import (ShardedStateLayout, Slices, check_elementwise, clip_by_global_norm, squared_norm_everywhere)

__all__ = ["ShardedStateLayout", "Slices", "check_elementwise", "clip_by_global_norm", "squared_norm_everywhere"]
