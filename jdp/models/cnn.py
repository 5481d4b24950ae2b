"""A small CNN with BatchNorm for 8×8 single-channel digit images (Flax NNX).

BatchNorm makes the forward pass stateful: in train mode it normalises with the statistics of
the batch it sees and updates its running averages (`nnx.BatchStat` variables). With
`sync_batchnorm=True` every BatchNorm takes `axis_name` (default `DATA_AXIS`; hybrid sharding's two
axes, `jdp.core.mesh.device_axes`), so inside `jax.shard_map` / `jax.pmap` over that axis its batch
mean and variance are `lax.pmean`-ed over the devices: the
statistics of the whole global batch, identical on every device (SyncBatchNorm).
Without it each device normalises with its own shard's statistics, and the model the devices
train is not the model one device would train on the global batch.
"""
from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jdp.core.mesh import DATA_AXIS
from jdp.models.dtypes import compute_dtype

IMAGE_SHAPE = (8, 8, 1)


class CNN(nnx.Module):
    """(conv 3×3 → BatchNorm → relu) twice, a 2×2 average pool after the first, then a dense head.

    Input (batch, 8, 8, 1) float32, or (batch, 64) as `jdp.data.load_digits` returns it;
    output (batch, num_classes) logits. With channels=(c1, c2): 8×8×c1 → pool → 4×4×c2 → dense.

    Params float32; compute in `dtype` (None: float32; jnp.bfloat16 / "bf16": bfloat16 convs and
    matmuls); logits float32. BatchNorm's statistics are computed and kept in float32 either way.
    """

    def __init__(self, num_classes: int = 10, channels: Sequence[int] = (16, 32), *,
                 sync_batchnorm: bool = False, dtype=None, rngs: nnx.Rngs, axis_name: str | tuple = DATA_AXIS):
        if len(channels) != 2 or any(int(c) < 1 for c in channels):
            raise ValueError(f"channels={tuple(channels)} must be two positive channel counts.")
        if int(num_classes) < 1:
            raise ValueError(f"num_classes={num_classes} must be positive.")
        c1, c2 = (int(c) for c in channels)
        axis_name = axis_name if sync_batchnorm else None
        # BatchNorm with a bfloat16 `dtype` still computes its batch statistics in float32 and
        # creates its running averages (nnx.BatchStat) in float32; only the normalised output is bf16.
        kw = dict(dtype=compute_dtype(dtype), param_dtype=jnp.float32, rngs=rngs)
        # No conv bias: the BatchNorm that follows subtracts the mean and adds its own bias.
        self.conv1 = nnx.Conv(IMAGE_SHAPE[-1], c1, (3, 3), use_bias=False, **kw)
        self.bn1 = nnx.BatchNorm(c1, axis_name=axis_name, **kw)
        self.conv2 = nnx.Conv(c1, c2, (3, 3), use_bias=False, **kw)
        self.bn2 = nnx.BatchNorm(c2, axis_name=axis_name, **kw)
        self.head = nnx.Linear(4 * 4 * c2, int(num_classes), **kw)

    def __call__(self, x: jax.Array, *, train: bool = True) -> jax.Array:
        """(batch, 8, 8, 1) or (batch, 64) float → (batch, num_classes) float32 logits.

        train=True: normalise with this batch's statistics (the global batch's under shard_map
        with sync_batchnorm) and update the running averages in place. train=False: use the
        running averages, change nothing.
        """
        if x.ndim == 2:
            x = x.reshape(x.shape[0], *IMAGE_SHAPE)
        if x.shape[1:] != IMAGE_SHAPE:
            raise ValueError(f"CNN expects images of shape (batch, 8, 8, 1) or (batch, 64), got {x.shape}.")
        x = nnx.relu(self.bn1(self.conv1(x), use_running_average=not train))
        x = nnx.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = nnx.relu(self.bn2(self.conv2(x), use_running_average=not train))
        return self.head(x.reshape(x.shape[0], -1)).astype(jnp.float32)
