"""Hugging Face GPT-2 checkpoints in jdp's GPT: the same model, so the same logits and the same training.

A model directory as `transformers` writes it (`save_pretrained`): `config.json` (a `GPT2Config`,
model_type "gpt2") and `model.safetensors` (or its shards and `model.safetensors.index.json`),
with `tokenizer.json` beside them where the model has one (`jdp data prepare-tokens --tokenizer
DIR/tokenizer.json` tokenizes for it). GPT-2 is jdp's GPT with biases everywhere, a tied head
(unless `tie_word_embeddings` is false), LayerNorm epsilon `layer_norm_epsilon` (1e-5) and the tanh
GELU ("gelu_new"); its attention scales by 1/sqrt(head_dim), as nnx's does.

How the weights map: GPT-2's Conv1D stores its kernel (in, out), as nnx's Linear does, so no
transpose (torch's Linear, nanoGPT's, stores (out, in)); `attn.c_attn` holds q | k | v in one
(d_model, 3·d_model) kernel, head-major within each, which nnx keeps as three (d_model, heads,
head_dim) kernels; `lm_head.weight` (an untied head only) is a torch Linear's (vocab, d_model).

The weights are read with numpy, one tensor at a time (`jdp.models.hub.folder`): no torch, no second
copy of the checkpoint. A directory holding only `pytorch_model.bin` is refused: reading it means
unpickling, which runs code from the file; convert it once with transformers
(`GPT2LMHeadModel.from_pretrained(DIR).save_pretrained(DIR2)` writes safetensors).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from jdp.models.gpt import GPT
from jdp.models.hub.folder import checkpoint_tensors, read_config
from jdp.models.hub.weights import build_model, install_params
from jdp.text import quoted

# GPT-2's activation names → jdp's gelu_approximate (the tanh GELU, or the exact erf one).
GELUS = {"gelu_new": True, "gelu_pytorch_tanh": True, "gelu": False}
# GPT-2 options jdp's GPT does not have, with the value it would need.
UNSUPPORTED = {"scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "add_cross_attention": False}


@dataclass(frozen=True)
class GPT2Architecture:
    """What a GPT-2 `config.json` says about the model, in jdp's GPT's terms."""

    vocab_size: int
    context: int  # n_positions: the position embeddings
    d_model: int  # n_embd
    n_heads: int  # n_head
    n_layers: int  # n_layer
    gelu_approximate: bool  # activation_function "gelu_new"/"gelu_pytorch_tanh" (True) or "gelu" (False)
    ln_epsilon: float  # layer_norm_epsilon
    tie_embeddings: bool  # tie_word_embeddings

    def gpt_options(self) -> dict:
        """The keyword arguments of `GPT` that make this architecture (biases on, as GPT-2 has them)."""
        return dict(vocab_size=self.vocab_size, context=self.context, d_model=self.d_model, n_heads=self.n_heads,
                    n_layers=self.n_layers, bias=True, tie_embeddings=self.tie_embeddings,
                    gelu_approximate=self.gelu_approximate, ln_epsilon=self.ln_epsilon)


def _not_gpt2(path: str, why: str) -> ValueError:
    return ValueError(f"{quoted(path)} is not a Hugging Face GPT-2 checkpoint: {why}.")


def read_architecture(path: str, config: dict | None = None) -> GPT2Architecture:
    """The architecture in `path`/config.json (or `config`, that file as read); ValueError (one sentence) for
    a directory that is not a GPT-2 checkpoint, or a GPT-2 option jdp's GPT cannot compute (naming it)."""
    config = read_config(path) if config is None else config
    if config.get("model_type") != "gpt2":
        raise _not_gpt2(path, f"its config.json has model_type {config.get('model_type')!r}, and gpt_from_hf reads "
                              f"'gpt2' (jdp.models.from_hf reads the Llama family too)")
    sizes = {key: config.get(key) for key in ("vocab_size", "n_positions", "n_embd", "n_head", "n_layer")}
    bad = [f"{k}={v!r}" for k, v in sizes.items() if isinstance(v, bool) or not isinstance(v, int) or v < 1]
    if bad:
        raise _not_gpt2(path, f"its config.json has {', '.join(bad)}, where positive integers belong")
    d_model, activation = sizes["n_embd"], config.get("activation_function", "gelu_new")
    if activation not in GELUS:
        raise ValueError(f"{quoted(path)}: activation_function {activation!r} is not one jdp's GPT computes; it "
                         f"computes {', '.join(map(repr, GELUS))}.")
    if config.get("n_inner") not in (None, 4 * d_model):
        raise ValueError(f"{quoted(path)}: n_inner={config['n_inner']!r}; jdp's GPT has an MLP of 4 × n_embd = "
                         f"{4 * d_model} (n_inner null or {4 * d_model}).")
    for key, needed in UNSUPPORTED.items():
        if config.get(key, needed) != needed:
            raise ValueError(f"{quoted(path)}: {key}={config[key]!r}; jdp's GPT computes only {key}={needed!r}.")
    if d_model % sizes["n_head"]:
        raise _not_gpt2(path, f"its n_embd={d_model} is not divisible by n_head={sizes['n_head']}")
    epsilon = config.get("layer_norm_epsilon", 1e-5)
    if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not epsilon > 0:
        raise _not_gpt2(path, f"its layer_norm_epsilon={epsilon!r} is not a positive number")
    return GPT2Architecture(sizes["vocab_size"], sizes["n_positions"], d_model, sizes["n_head"], sizes["n_layer"],
                            GELUS[activation], float(epsilon), bool(config.get("tie_word_embeddings", True)))


def read_weights(path: str) -> dict[str, np.ndarray]:
    """GPT-2's tensors in `path`, float32, named as GPT2LMHeadModel names them (`transformer.` prefixed:
    a GPT2Model's bare names get it); its attention-mask buffers (`attn.bias`, `attn.masked_bias`) left out.
    Each tensor is read and converted on its own."""
    out = {}
    for name, value in checkpoint_tensors(path, "GPT2LMHeadModel"):
        if name.endswith((".attn.bias", ".attn.masked_bias")):
            continue  # older checkpoints saved the causal mask; jdp makes its own
        if name != "lm_head.weight" and not name.startswith("transformer."):
            name = "transformer." + name
        out[name] = np.array(value, np.float32)
    return out


def gpt2_params(sd: dict[str, np.ndarray], arch: GPT2Architecture, where: str) -> dict:
    """GPT-2's state dict `sd` (as `read_weights` gives it) → the params of an unscanned `GPT(**arch.gpt_options())`,
    as nested dicts. ValueError naming any missing or unused entry."""
    d, h, n = arch.d_model, arch.n_heads, arch.n_layers
    hd, used = d // h, set()

    def take(name):
        if name not in sd:
            raise ValueError(f"{where}: the weights lack {name!r}, which a GPT-2 of config.json's sizes has.")
        used.add(name)
        return sd[name]

    def linear(prefix, kernel_shape, bias_shape):  # Conv1D: (in, out) as nnx, no transpose
        return {"kernel": take(prefix + ".weight").reshape(kernel_shape), "bias": take(prefix + ".bias").reshape(bias_shape)}

    def norm(prefix):
        return {"scale": take(prefix + ".weight"), "bias": take(prefix + ".bias")}

    params = {"tok_embed": {"embedding": take("transformer.wte.weight")},
              "pos_embed": {"embedding": take("transformer.wpe.weight")},
              "ln_f": norm("transformer.ln_f"), "blocks": {}}
    if not arch.tie_embeddings:
        params["head"] = {"kernel": take("lm_head.weight").T}  # a torch Linear: (vocab, d_model)
    elif "lm_head.weight" in sd:  # some writers save the tied copy too: it must be the embedding
        if not np.array_equal(take("lm_head.weight"), sd["transformer.wte.weight"]):
            raise ValueError(f"{where}: config.json ties the head to the token embedding (tie_word_embeddings), but "
                             f"lm_head.weight differs from transformer.wte.weight.")
    for i in range(n):
        p = f"transformer.h.{i}."
        qkv = take(p + "attn.c_attn.weight").reshape(d, 3, h, hd)  # columns: q | k | v, head-major
        qkv_bias = take(p + "attn.c_attn.bias").reshape(3, h, hd)
        attn = {name: {"kernel": qkv[:, j], "bias": qkv_bias[j]} for j, name in enumerate(("query", "key", "value"))}
        attn["out"] = linear(p + "attn.c_proj", (h, hd, d), (d,))
        params["blocks"][i] = {"ln1": norm(p + "ln_1"), "attn": attn, "ln2": norm(p + "ln_2"),
                               "fc": linear(p + "mlp.c_fc", (d, 4 * d), (4 * d,)),
                               "proj": linear(p + "mlp.c_proj", (4 * d, d), (d,))}
    if set(sd) - used:
        raise ValueError(f"{where}: the weights have entries a GPT-2 of config.json's {n} layers does not: "
                         f"{sorted(set(sd) - used)[:5]}.")
    return params


def gpt_from_hf(path: str | os.PathLike, *, dtype=None, attention: str = "flax", dropout: float = 0.0,
                remat: bool = False, scan_layers: bool = False) -> GPT:
    """jdp's `GPT` holding the Hugging Face GPT-2 checkpoint in directory `path`, computing the same function.

    Args:
      path: a directory `save_pretrained` wrote: config.json (model_type "gpt2") and model.safetensors.
      dtype, attention, dropout, remat, scan_layers: jdp's `GPT` options (compute dtype; attention
        function; dropout rate, 0 by default as for inference; rematerialised or scanned blocks).

    Returns:
      A `GPT` of config.json's sizes (vocab_size, context n_positions, d_model n_embd, n_heads,
      n_layers), with biases, its tie, GELU and LayerNorm epsilon. Its float32 logits (batch, T,
      vocab) equal `transformers.GPT2LMHeadModel(...)(ids).logits` to float32 rounding.
    """
    path = os.fspath(path)
    arch = read_architecture(path)
    params = gpt2_params(read_weights(path), arch, quoted(path))
    model = build_model(lambda rngs: GPT(**arch.gpt_options(), dropout=dropout, dtype=dtype, attention=attention,
                                         remat=remat, scan_layers=scan_layers, rngs=rngs))
    return install_params(model, params, quoted(path))


__all__ = ["GPT2Architecture", "gpt2_params", "gpt_from_hf", "read_architecture", "read_weights"]
