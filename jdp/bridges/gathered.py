"""A Flax module whose params are whole inside per-layer FSDP: `gathered`, for NNX and Linen.

Under `shard_params=True, gather_in_model=True` a model's params arrive as `jdp.fsdp.Split` blocks.
A scanned, rematerialised body calls its layer through `gathered(layer)`: one all-gather per leaf,
inside the body, so one layer is whole at a time and the backward pass reduce-scatters its gradient
as it makes it. Outside that layout there is no `Split` and `gathered` changes nothing.
"""
from __future__ import annotations

from jdp.core.split import gather


def gathered(module):
    """`module` with its `Split` params made whole (`jdp.fsdp.gather`: one all-gather each).

    - A Flax NNX module (`nnx.Module`): a copy of it, its params whole (`nnx.split`, gather,
      `nnx.merge`); `module` itself is left as it is. Call it where the layer runs, inside the scan's
      body: `gathered(block)(x)`.
    - A Flax Linen module class: the class wrapped by `nn.map_variables(module, "params",
      trans_in_fn=jdp.fsdp.gather, init=True)`, which reads its params whole; scan the wrapped
      class (`nn.scan(nn.remat(gathered(Block)), ...)`) or construct it as the class itself
      (`gathered(nn.Dense)(16)`).

    Shapes and values are the whole model's: on one device, replicated or under ZeRO-1 (no
    `Split`), the NNX copy holds the same params and the Linen wrapper reads them unchanged.
    """
    from flax import linen as nn
    from flax import nnx

    if isinstance(module, nnx.Module):
        graphdef, state = nnx.split(module)
        return nnx.merge(graphdef, gather(state))
    if isinstance(module, type) and issubclass(module, nn.Module):
        return nn.map_variables(module, "params", trans_in_fn=gather, init=True)
    raise ValueError(f"gathered takes a Flax NNX module or a Flax Linen module class, got {module!r} "
                     f"({type(module).__name__}).")


__all__ = ["gathered"]
