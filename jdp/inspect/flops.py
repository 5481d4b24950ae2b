"""Model FLOPs of a training step: what MFU divides by the step time, counted from the MODEL.

Not from the compiled program: XLA's cost analysis of a compiled GPU step leaves out cuBLAS GEMMs and
cuDNN attention (custom calls there) and counts rematerialisation's recomputation, so its MFU is off
by 6× to 200× on a GPU while it happens to look right on a CPU. Two counts, each named in the record:

- jdp's GPT: nanoGPT's (PaLM's) count, 6·N + 12·L·H·Q·T FLOPs per token, N every param but the position
  embedding (`gpt_flops_per_token`).
- any other model: 3 × the FLOPs of its forward pass, read from the traced program before any
  optimisation (the jaxpr: `dot_general`s, convolutions and cuDNN attention calls by their shapes;
  `program_forward_flops`): the backward pass of a matmul is two matmuls of its size. Elementwise
  work (activations, norms, the optimizer) is not counted, as in the GPT's count. A rematerialised
  block is traced once in the forward pass, so its recomputation is never counted (that would be
  hardware FLOPs, not model FLOPs).
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np

GPT_SOURCE = "gpt: 6N+12LHQT"
PROGRAM_SOURCE = "program: 3 x forward dot_general/conv/attention"


@dataclass(frozen=True)
class ModelFlops:
    """Model FLOPs of one optimizer step over the whole global batch, and which count gave them."""

    per_step: float
    source: str  # GPT_SOURCE or PROGRAM_SOURCE


def gpt_flops_per_token(n_params: int, n_layers: int, d_model: int, seq_len: int) -> int:
    """nanoGPT's model FLOPs per token of one training step (forward and backward), an exact integer:
    6·N (a multiply-add per param, forward 2, backward 4) + 12·L·H·Q·T (attention's scores and
    weighted sum over all T positions, H·Q = d_model). `n_params`: N, every param but the position
    embedding (`gpt_params_without_position`)."""
    return 6 * int(n_params) + 12 * int(n_layers) * int(d_model) * int(seq_len)


def gpt_params_without_position(params) -> int:
    """N of the GPT's count: the number of params in the `params` tree (jdp's GPT's nnx state or its
    pure dict) outside `pos_embed`."""
    leaves = jax.tree_util.tree_leaves_with_path(params)
    return int(sum(np.size(x) for path, x in leaves if "pos_embed" not in jax.tree_util.keystr(path)))


def _dot_general_flops(eqn) -> int:
    """2 × (output elements) × (contracted size): each output element is a dot product."""
    lhs = eqn.invars[0].aval.shape
    (contract, _), _ = eqn.params["dimension_numbers"]
    k = int(np.prod([lhs[d] for d in contract], dtype=np.int64))
    return 2 * k * int(np.prod(eqn.outvars[0].aval.shape, dtype=np.int64))


def _conv_flops(eqn) -> int:
    """2 × (output elements) × (kernel elements per output feature): kernel size ÷ output features."""
    rhs = eqn.invars[1].aval.shape
    out_features = rhs[eqn.params["dimension_numbers"].rhs_spec[0]]
    per_output = int(np.prod(rhs, dtype=np.int64)) // out_features // eqn.params["feature_group_count"]
    return 2 * per_output * int(np.prod(eqn.outvars[0].aval.shape, dtype=np.int64))


def _cudnn_attention_flops(eqn) -> int:
    """cuDNN's fused attention, forward: scores Q·Kᵀ and their weighted sum of V over all key positions,
    4 × (query elements) × S, the causal half included, as the XLA attention's two matmuls count it."""
    q, k = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
    bnth = getattr(eqn.params.get("layout"), "value", eqn.params.get("layout")) == 1
    return 4 * int(np.prod(q, dtype=np.int64)) * k[2 if bnth else 1]


COUNTED = {"dot_general": _dot_general_flops, "conv_general_dilated": _conv_flops,
           "dot_product_attention_fwd_wrapper": _cudnn_attention_flops}
# The backward pass's own calls (seen only in a program that differentiates): never model FLOPs here.
SKIPPED = ("dot_product_attention_bwd_wrapper", "custom_vjp_call_jaxpr_bwd")


def jaxpr_flops(jaxpr) -> int:
    """FLOPs of `jaxpr`'s matmuls, convolutions and cuDNN attention calls, each counted where it is
    traced: a `scan` body × its length, a `cond` by its costliest branch, any other nested program
    (jit, remat, custom_jvp/vjp, shard_map) once. A `while` body counts once (its trip count is not
    in the program)."""
    total = 0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in COUNTED:
            total += COUNTED[name](eqn)
        elif name == "cond":
            total += max(jaxpr_flops(b.jaxpr) for b in eqn.params["branches"])
        elif name not in SKIPPED:
            inner = sum(jaxpr_flops(j) for j in _subjaxprs(eqn.params))
            total += inner * (eqn.params["length"] if name == "scan" else 1)
    return total


def _subjaxprs(params: dict):
    """The programs nested in an equation's params (as jax's core finds them): Jaxprs and ClosedJaxprs,
    alone or in tuples. A custom_vjp's backward function is not a program here, so it is not counted."""
    from jax.extend.core import ClosedJaxpr, Jaxpr

    for value in params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, ClosedJaxpr):
                yield v.jaxpr
            elif isinstance(v, Jaxpr):
                yield v


def program_forward_flops(fn, *args, axis_env=None) -> int:
    """FLOPs of one forward call `fn(*args)`, from its traced program (`jaxpr_flops`). `args` may be
    arrays or `jax.ShapeDtypeStruct`s; `axis_env`: [(axis name, size)] for collectives inside `fn`."""
    return jaxpr_flops(jax.make_jaxpr(fn, axis_env=axis_env or ())(*args).jaxpr)


def program_model_flops(fn, *args, examples_scale: float = 1.0, axis_env=None) -> ModelFlops:
    """Model FLOPs of a training step whose forward pass is `fn(*args)`: 3 × its forward FLOPs (a
    matmul's backward is two matmuls of its size) × `examples_scale` (the global batch ÷ the traced
    batch, e.g. devices × accumulation steps for one device's micro-batch)."""
    return ModelFlops(3.0 * program_forward_flops(fn, *args, axis_env=axis_env) * examples_scale, PROGRAM_SOURCE)


__all__ = ["GPT_SOURCE", "PROGRAM_SOURCE", "ModelFlops", "gpt_flops_per_token", "gpt_params_without_position",
           "jaxpr_flops", "program_forward_flops", "program_model_flops"]
