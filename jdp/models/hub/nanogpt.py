"""nanoGPT's weights in jdp's GPT: the same model, so the same logits and the same training.

karpathy/nanoGPT's `model.py` GPT is pre-LayerNorm with learned position embeddings, as jdp's
GPT is; it differs in four choices that `GPT` takes as options: the token embedding is also the
output head (`tie_embeddings=True`), GELU is exact (`gelu_approximate=False`), LayerNorm's epsilon
is 1e-5, and `bias` is on or off everywhere. Its attention keeps q, k and v in one Linear
(`c_attn`, output 3·d_model) that `nnx.MultiHeadAttention` keeps as three (d_model, heads,
head_dim) kernels; torch's Linear stores (out, in), nnx's (in, out).
"""
from __future__ import annotations

import re
from collections.abc import Mapping

import numpy as np
from flax import nnx

from jdp.models.gpt import GPT
from jdp.models.hub.weights import shape_mismatches


def _array(value) -> np.ndarray:
    """A torch tensor (on any device) or array-like → a float32 numpy copy, without importing torch.

    A copy: `tensor.numpy()` shares the tensor's memory, which torch's optimizer updates in place."""
    if hasattr(value, "detach"):
        value = value.detach().cpu().float().numpy()
    return np.array(value, dtype=np.float32)


def _n_layers(names) -> int:
    layers = {int(m.group(1)) for m in map(re.compile(r"transformer\.h\.(\d+)\.").match, names) if m}
    if layers != set(range(len(layers))):
        raise ValueError(f"the state dict's layers are {sorted(layers)}; expected 0 .. n-1.")
    return len(layers)


def _nanogpt_params(sd: dict, used: set, n_layers: int, n_heads: int, d_model: int, bias: bool) -> dict:
    """nanoGPT's state dict `sd` → the params of an unscanned tied `GPT` (nested dicts; the untied head is
    the caller's), adding each name it takes to `used`. torch Linear (out, in) → nnx (in, out); c_attn's
    q | k | v columns, head-major, → three (d_model, heads, head_dim) kernels."""
    hd = d_model // n_heads

    def take(name):
        used.add(name)
        return sd[name]

    def linear(prefix, kernel_shape, bias_shape):
        out = {"kernel": take(prefix + ".weight").T.reshape(kernel_shape)}
        if bias:
            out["bias"] = take(prefix + ".bias").reshape(bias_shape)
        return out

    def norm(prefix):
        return {"scale": take(prefix + ".weight"), **({"bias": take(prefix + ".bias")} if bias else {})}

    params = {"tok_embed": {"embedding": take("transformer.wte.weight")},
              "pos_embed": {"embedding": take("transformer.wpe.weight")},
              "ln_f": norm("transformer.ln_f"), "blocks": {}}
    for i in range(n_layers):
        p = f"transformer.h.{i}."
        qkv = take(p + "attn.c_attn.weight").T.reshape(d_model, 3, n_heads, hd)  # columns: q | k | v, head-major
        qkv_bias = take(p + "attn.c_attn.bias").reshape(3, n_heads, hd) if bias else None
        attn = {name: {"kernel": qkv[:, j], **({"bias": qkv_bias[j]} if bias else {})}
                for j, name in enumerate(("query", "key", "value"))}
        attn["out"] = linear(p + "attn.c_proj", (n_heads, hd, d_model), (d_model,))
        params["blocks"][i] = {"ln1": norm(p + "ln_1"), "attn": attn, "ln2": norm(p + "ln_2"),
                               "fc": linear(p + "mlp.c_fc", (d_model, 4 * d_model), (4 * d_model,)),
                               "proj": linear(p + "mlp.c_proj", (4 * d_model, d_model), (d_model,))}
    return params


def gpt_from_nanogpt(state_dict: Mapping, n_heads: int, *, dtype=None, attention: str = "flax") -> GPT:
    """jdp's `GPT` holding the params of a nanoGPT `GPT` (`model.state_dict()`), computing the same function.

    Args:
      state_dict: nanoGPT's names → torch tensors or arrays: `transformer.wte.weight` (vocab,
        d_model), `transformer.wpe.weight` (context, d_model), per layer `ln_1`, `attn.c_attn`
        (3·d_model, d_model), `attn.c_proj`, `ln_2`, `mlp.c_fc`, `mlp.c_proj`, then `ln_f` and
        `lm_head.weight`. vocab, context, d_model and n_layers come from the shapes, `bias` from
        whether the LayerNorms have one. The causal-mask buffers (`attn.bias`, 4-D) are skipped.
      n_heads: nanoGPT's `n_head` (the shapes do not hold it).
      dtype, attention: jdp's `GPT` options (compute dtype; attention function).

    Returns:
      A `GPT` with dropout 0, `gelu_approximate=False`, `ln_epsilon=1e-5`, and
      `tie_embeddings=True` unless `lm_head.weight` differs from `wte` (then an untied head with
      lm_head's matrix). Its float32 logits (batch, T, vocab) equal nanoGPT's `model(idx, targets)[0]`
      to float32 rounding.
    """
    sd = {k: _array(v) for k, v in state_dict.items()
          if not (k.endswith(".attn.bias") and np.ndim(_array(v)) == 4)}
    missing = [k for k in ("transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight") if k not in sd]
    if missing:
        raise ValueError(f"this is not a nanoGPT state dict: it lacks {missing}.")
    vocab, d_model = sd["transformer.wte.weight"].shape
    context = sd["transformer.wpe.weight"].shape[0]
    if n_heads < 1 or d_model % n_heads:
        raise ValueError(f"n_heads={n_heads} must be positive and divide the state dict's d_model={d_model}.")
    n_layers, bias = _n_layers(sd), "transformer.ln_f.bias" in sd
    head = sd.get("lm_head.weight", sd["transformer.wte.weight"])
    tied = np.array_equal(head, sd["transformer.wte.weight"])
    model = GPT(vocab, context, d_model, n_heads, n_layers, dropout=0.0, dtype=dtype, attention=attention,
                bias=bias, tie_embeddings=tied, gelu_approximate=False, ln_epsilon=1e-5, rngs=nnx.Rngs(0))
    used = {"lm_head.weight"} & set(sd)
    params = _nanogpt_params(sd, used, n_layers, n_heads, d_model, bias)
    if not tied:
        params["head"] = {"kernel": head.T}
    if set(sd) - used:
        raise ValueError(f"the state dict has entries a nanoGPT GPT does not: {sorted(set(sd) - used)}.")
    wrong = shape_mismatches(model, params)
    if wrong:
        raise ValueError(f"the state dict's shapes do not make a GPT (state dict for jdp): {wrong}.")
    nnx.update(model, params)
    return model

