"""Mixed precision: float32 master params and optimizer state, bf16 forward and backward.

With `precision="bfloat16"` the step runs the loss on a bf16 copy of the params and of the batch's
float inputs; the gradient flows back through that cast into the float32 params, so it reaches the
reduction and the optimizer in float32. Which part runs in which dtype:

| part                                   | float32 | bfloat16 |
|----------------------------------------|---------|----------|
| params (master weights), optimizer state, model state (BatchNorm statistics) | float32 | float32 |
| forward and backward: matmuls, convolutions, activations | float32 | bfloat16 |
| logits, softmax and loss (jdp's models return float32 logits) | float32 | float32 |
| gradient out of the backward pass, accumulation sums, grad_norm | float32 | float32 |
| gradient all-reduce (`reduce_dtype`, default: the gradient's own) | float32 | float32, or bfloat16 |
| optimizer update | float32 | float32 |

`reduce_dtype="bfloat16"` halves the gradient all-reduce's bytes: each device divides its bf16
gradient by N before the sum (so it cannot overflow), and the mean is cast back to float32 for the
optimizer. It rounds the gradient to bf16's 8 bits of mantissa; `jdp explain` measures what that
costs against one float32 device.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jdp.core.split import is_split
from jdp.text import shorten

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
ALIASES = {"fp32": "float32", "bf16": "bfloat16"}


def dtype_name(value, field: str, allow_none: bool = False) -> str | None:
    """`value` (a name such as "bf16"/"bfloat16", or a dtype such as jnp.bfloat16) as "float32" or
    "bfloat16"; ValueError in one sentence for anything else (float16 needs loss scaling, which jdp
    does not implement)."""
    if value is None and allow_none:
        return None
    if isinstance(value, str):
        name, shown = value, repr(value)
    else:
        try:
            name = shown = np.dtype(value).name
        except TypeError:
            name, shown = None, repr(value)
    name = ALIASES.get(name, name)
    if name in DTYPES:
        return name
    allowed = ("None, " if allow_none else "") + "'float32' ('fp32') or 'bfloat16' ('bf16')"
    why = (" (float16 needs loss scaling, which jdp does not implement; bfloat16 has float32's range)"
           if name in ("float16", "fp16", "half") else "")
    raise ValueError(f"{field}={shorten(shown)} is not supported{why}; use {allowed}.")


def cast_floats(tree, dtype):
    """`tree` with every floating leaf cast to `dtype` (integer tokens, labels and keys untouched)."""
    # a `Split` (a block the model gathers itself) records the cast and applies it after its gather
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype if is_split(x) else jnp.result_type(x),
                                                                  jnp.floating) else x, tree, is_leaf=is_split)


def in_precision(loss, precision: str, mask_key: str | None):
    """`loss(params, model_state, batch, key) -> (total, (aux, model_state, weight))` run in `precision`.

    bfloat16: params and the batch's float leaves (not the mask, nor an entry named "mask": it
    counts examples) are cast to bf16 before the call; the loss, aux and weight come back as float32
    and the model state in its own dtype, so the float32 model state never degrades. float32
    returns `loss` itself.
    """
    if precision == "float32":
        return loss
    low = DTYPES[precision]
    kept = {mask_key, "mask"}  # a mask counts examples: never rounded to bf16 (bf16 counts 257 as 256)

    def cast_call(params, model_state, batch, key):
        inputs = ({k: (v if k in kept else cast_floats(v, low)) for k, v in batch.items()}
                  if isinstance(batch, dict) else cast_floats(batch, low))
        total, (aux, new_state, weight) = loss(cast_floats(params, low), model_state, inputs, key)
        new_state = jax.tree.map(lambda new, old: new.astype(jnp.result_type(old)), new_state, model_state)
        weight = None if weight is None else weight.astype(jnp.float32)
        return total.astype(jnp.float32), (cast_floats(aux, jnp.float32), new_state, weight)

    return cast_call


def check_master_params(params, precision: str) -> None:
    """Refuse, with mixed precision, float params that are not float32: they are the master copy."""
    if precision == "float32":
        return
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        dtype = jnp.result_type(leaf)
        if jnp.issubdtype(dtype, jnp.floating) and dtype != jnp.float32:
            raise ValueError(f"params{jax.tree_util.keystr(path)} is {dtype}; precision={precision!r} keeps "
                             f"float32 master params and computes in {precision}: pass float32 params.")


def check_trainable(params) -> None:
    """Refuse, naming the leaf, params that `jax.grad` cannot differentiate (integer or bool leaves)."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        dtype = jnp.result_type(leaf)
        if not jnp.issubdtype(dtype, jnp.inexact):
            raise ValueError(f"params{jax.tree_util.keystr(path)} is {dtype}, and the step differentiates every "
                             f"leaf of params, which needs floating-point leaves; keep non-trainable values (counters, "
                             f"masks, statistics) in the model state (has_state=True, `step.init(params, "
                             f"model_state)`), which loss_fn receives and may update.")
