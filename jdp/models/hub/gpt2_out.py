"""jdp's GPT out as a Hugging Face GPT-2 directory: `transformers`' `GPT2LMHeadModel.from_pretrained(OUT)`
computes the same logits.

The inverse of `jdp.models.hub.gpt2_in`: config.json (a GPT2Config: sizes, `activation_function` "gelu_new"
for the tanh GELU or "gelu" for the exact one, `layer_norm_epsilon`, `tie_word_embeddings`) and
model.safetensors (float32, transformers' names; a tied head is written once, as the embedding).
Every GPT jdp builds is a GPT-2: a model without biases (`bias=False`) is written with zero biases,
which compute the same function (transformers then trains them from zero). The dropout rates are the
model's (`resid_pdrop`, `embd_pdrop`; `attn_pdrop` 0: jdp drops no attention weights).

Nothing is overwritten (`jdp.models.hub.folder.write_folder`): OUT must not exist or be an empty
directory, and not a link.
"""
from __future__ import annotations

import json
import os

import jax
import numpy as np
from flax import nnx

from jdp.models.gpt import GPT
from jdp.models.hub.folder import CONFIG, WEIGHTS, check_tokenizer_file, copy_tokenizer, write_folder, write_json
from jdp.models.hub.safetensors_io import save as save_safetensors


def _architecture(model: GPT) -> dict:
    """The GPT2Config fields of `model` (its attributes and shapes)."""
    block = model.layers if model.scan_layers else model.blocks[0]
    d_model = model.tok_embed.features
    return {"vocab_size": model.vocab_size, "n_positions": model.context, "n_embd": d_model,
            "n_head": block.attn.num_heads, "n_layer": model.n_layers, "n_inner": None,
            "activation_function": "gelu_new" if block.gelu_approximate else "gelu",
            "layer_norm_epsilon": model.ln_f.epsilon, "tie_word_embeddings": model.tie_embeddings}


def _unscanned_blocks(params: dict, model: GPT) -> list[dict]:
    """Each layer's params: a scanned model's stacked `layers` cut along their leading axis."""
    if model.scan_layers:
        return [jax.tree.map(lambda a, i=i: a[i], params["layers"]) for i in range(model.n_layers)]
    return [params["blocks"][i] for i in range(model.n_layers)]


def gpt2_state_dict(model: GPT) -> dict[str, np.ndarray]:
    """`model`'s params under GPT2LMHeadModel's names, float32 (Conv1D kernels (in, out); q, k and v
    joined head-major into c_attn; an untied head as a torch Linear's (vocab, d_model)); zeros for the
    biases of a model without them."""
    params = jax.tree.map(lambda a: np.asarray(a, np.float32), nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    d = model.tok_embed.features

    def bias_of(layer, size):
        return layer["bias"].reshape(-1) if "bias" in layer else np.zeros(size, np.float32)

    def conv1d(prefix, layer, n_in, n_out):
        return {prefix + ".weight": layer["kernel"].reshape(n_in, n_out), prefix + ".bias": bias_of(layer, n_out)}

    def norm(prefix, layer):
        return {prefix + ".weight": layer["scale"], prefix + ".bias": bias_of(layer, d)}

    sd = {"transformer.wte.weight": params["tok_embed"]["embedding"],
          "transformer.wpe.weight": params["pos_embed"]["embedding"], **norm("transformer.ln_f", params["ln_f"])}
    if not model.tie_embeddings:
        sd["lm_head.weight"] = params["head"]["kernel"].T
    for i, block in enumerate(_unscanned_blocks(params, model)):
        p, attn = f"transformer.h.{i}.", block["attn"]
        qkv = [attn[name]["kernel"].reshape(d, d) for name in ("query", "key", "value")]
        sd[p + "attn.c_attn.weight"] = np.concatenate(qkv, axis=1)
        sd[p + "attn.c_attn.bias"] = np.concatenate([bias_of(attn[name], d) for name in ("query", "key", "value")])
        for part in (conv1d(p + "attn.c_proj", attn["out"], d, d), norm(p + "ln_1", block["ln1"]),
                     norm(p + "ln_2", block["ln2"]), conv1d(p + "mlp.c_fc", block["fc"], d, 4 * d),
                     conv1d(p + "mlp.c_proj", block["proj"], 4 * d, d)):
            sd.update(part)
    return {k: np.ascontiguousarray(v, np.float32) for k, v in sd.items()}


def _end_of_text(tokenizer_file: str | None) -> int | None:
    """The id of GPT-2's "<|endoftext|>" in the tokenizer.json, its bos and eos token; None without one."""
    if tokenizer_file is None:
        return None
    with open(tokenizer_file, encoding="utf-8") as f:
        spec = json.load(f)
    for token in spec.get("added_tokens") or []:
        if token.get("content") == "<|endoftext|>":
            return token.get("id")
    return ((spec.get("model") or {}).get("vocab") or {}).get("<|endoftext|>")


def gpt2_config(model: GPT, tokenizer_file: str | None = None) -> dict:
    """config.json for `model`: a GPT2Config's fields, with "<|endoftext|>" as bos/eos where the tokenizer has it."""
    eot = _end_of_text(tokenizer_file)
    eot = eot if isinstance(eot, int) and 0 <= eot < model.vocab_size else None
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", **_architecture(model),
            "resid_pdrop": model.dropout, "embd_pdrop": model.dropout, "attn_pdrop": 0.0,
            "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
            "bos_token_id": eot, "eos_token_id": eot, "dtype": "float32"}


def save_gpt2(model: GPT, out: str | os.PathLike, *, tokenizer_file: str | None = None) -> str:
    """Write `model` (a `jdp.models.GPT`) as a Hugging Face GPT-2 directory `out`; returns its path.

    `out` holds config.json, model.safetensors and, given `tokenizer_file` (a tokenizer.json),
    a copy of it as tokenizer.json. `GPT2LMHeadModel.from_pretrained(out)` gives logits equal to
    the model's (float32) on the same tokens. ValueError (one sentence) for an `out` that exists and is
    not an empty directory, or is a link; nothing is written then.
    """
    check_tokenizer_file(tokenizer_file)

    def write(staging: str) -> None:
        save_safetensors(gpt2_state_dict(model), os.path.join(staging, WEIGHTS), {"format": "pt"})
        write_json(os.path.join(staging, CONFIG), gpt2_config(model, tokenizer_file))
        copy_tokenizer(tokenizer_file, staging)

    return write_folder(out, write)


__all__ = ["gpt2_config", "gpt2_state_dict", "save_gpt2"]
