"""The compute dtype the models accept: float32 (the default) or bfloat16.

`dtype` follows Flax's meaning: the dtype layers compute in. Parameters are created and kept in
float32 whatever it is, and the models cast their logits to float32. float16 is refused: it
needs loss scaling to keep small gradients from underflowing, and jdp does not implement that.
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from jdp.core.precision import DTYPES, dtype_name


def compute_dtype(value: Any) -> jnp.dtype:
    """None, jnp.float32, jnp.bfloat16 or "float32"/"fp32"/"bfloat16"/"bf16" → jnp.dtype.

    None means float32. Anything else (float16/"fp16" included) raises a one-sentence ValueError.
    The names are the step's `precision` names (`jdp.core.precision.dtype_name`).
    """
    try:
        name = dtype_name(value, "dtype", allow_none=True)
    except ValueError:
        raise ValueError(f"dtype={value!r} is not a supported compute dtype; use None, jnp.float32, jnp.bfloat16 or "
                         f"one of 'float32', 'fp32', 'bfloat16', 'bf16' (float16 would need loss scaling, which jdp "
                         "does not implement).") from None
    return jnp.dtype(DTYPES[name or "float32"])
