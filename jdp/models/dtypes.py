"""The compute dtype the models accept: float32 (the default) or bfloat16.

`dtype` follows Flax's meaning: the dtype layers compute in. Parameters are created and kept in
float32 whatever it is, and the models cast their logits to float32. float16 is refused: it
needs loss scaling to keep small gradients from underflowing, and jdp does not implement that.
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp

_NAMES = {"float32": jnp.float32, "fp32": jnp.float32, "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16}
_ALLOWED = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def compute_dtype(value: Any) -> jnp.dtype:
    """None, jnp.float32, jnp.bfloat16 or "float32"/"fp32"/"bfloat16"/"bf16" → jnp.dtype.

    None means float32. Anything else (float16/"fp16" included) raises a one-sentence ValueError.
    """
    if value is None:
        return jnp.dtype(jnp.float32)
    if isinstance(value, str):
        dtype = jnp.dtype(_NAMES[value]) if value in _NAMES else None
    else:
        try:
            dtype = jnp.dtype(value)
        except (TypeError, ValueError):
            dtype = None
    if dtype is None or dtype not in _ALLOWED:
        raise ValueError(f"dtype={value!r} is not a supported compute dtype; use None, jnp.float32, jnp.bfloat16 or "
                         f"one of {', '.join(repr(n) for n in _NAMES)} (float16 would need loss scaling, which jdp "
                         "does not implement).")
    return dtype
