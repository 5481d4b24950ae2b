"""jdp's `Llama` out as a Hugging Face folder: `AutoModelForCausalLM.from_pretrained(OUT)` computes its logits.

The inverse of `jdp.models.hub.llama_in`: config.json with the architecture's keys under the names its
model_type uses ("llama", "qwen2", "mistral"; the rotary settings both as `rope_parameters`, which
transformers 5 reads, and as `rope_theta` + `rope_scaling`, which older releases read), and
model.safetensors under transformers' tensor names, projections transposed back to torch's (out, in).
A tied head is not written (transformers ties it to the embedding).

The tensors are written in `dtype`: by default the dtype the model's weights were read in
(`weights_dtype`, set by `from_hf`; float32 for a model jdp made), so `save_hf(from_hf(X), OUT)` gives
back X's tensors bit for bit. Nothing is overwritten (`jdp.models.hub.folder.write_folder`).
"""
from __future__ import annotations

import os

import jax
import ml_dtypes
import numpy as np
from flax import nnx

from jdp.models.hub.folder import CONFIG, WEIGHTS, check_tokenizer_file, copy_tokenizer, write_folder, write_json
from jdp.models.hub.llama_in import CLASSES, LAYER_TENSORS
from jdp.models.hub.safetensors_io import save as save_safetensors
from jdp.models.llama import Llama

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def _layers(params: dict, model: Llama) -> list[dict]:
    """Each layer's params: a scanned model's stacked `layers` cut along their leading axis."""
    if model.scan_layers:
        return [jax.tree.map(lambda a, i=i: a[i], params["layers"]) for i in range(model.n_layers)]
    return [params["blocks"][i] for i in range(model.n_layers)]


def _get(tree: dict, path: tuple):
    for key in path:
        if not isinstance(tree, dict) or key not in tree:
            return None
        tree = tree[key]
    return tree


def llama_state_dict(model: Llama, dtype=np.float32) -> dict[str, np.ndarray]:
    """`model`'s params under transformers' names (`model.` prefixed, `lm_head.weight` untied only), as
    `dtype` arrays; projections (in, out) → torch's (out, in)."""
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    sd = {"model.embed_tokens.weight": params["embed"]["embedding"], "model.norm.weight": params["norm"]["scale"]}
    if not model.tie_embeddings:
        sd["lm_head.weight"] = params["head"]["kernel"].T
    for i, layer in enumerate(_layers(params, model)):
        for name, (path, transposed) in LAYER_TENSORS.items():
            value = _get(layer, path)
            if value is not None:
                sd[f"model.layers.{i}.{name}"] = value.T if transposed else value
    return {k: np.ascontiguousarray(np.asarray(v, np.float32).astype(dtype)) for k, v in sd.items()}


def _rope_keys(model: Llama) -> dict:
    a, s = model.arch, model.arch.rope_scaling
    scaling = None if s is None else {"rope_type": s.kind, "factor": s.factor, **(
        {} if s.kind == "linear" else {"low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor,
                                       "original_max_position_embeddings": s.original_context})}
    parameters = {"rope_theta": a.rope_theta, **(scaling or {"rope_type": "default"})}
    return {"rope_theta": a.rope_theta, "rope_scaling": scaling, "rope_parameters": parameters}


def llama_config(model: Llama, dtype_name: str) -> dict:
    """config.json for `model`: its architecture under transformers' names for its model_type."""
    a = model.arch
    config = {"architectures": [CLASSES[a.model_type]], "model_type": a.model_type, "vocab_size": a.vocab_size,
              "hidden_size": a.d_model, "intermediate_size": a.d_ff, "num_hidden_layers": a.n_layers,
              "num_attention_heads": a.n_heads, "num_key_value_heads": a.n_kv_heads, "head_dim": a.head_dim,
              "max_position_embeddings": a.context, "rms_norm_eps": a.rms_norm_eps, "hidden_act": "silu",
              "tie_word_embeddings": a.tie_embeddings, "attention_dropout": 0.0, **_rope_keys(model),
              "bos_token_id": a.bos_token_id,
              "eos_token_id": list(a.eos_token_id) if isinstance(a.eos_token_id, tuple) else a.eos_token_id,
              "dtype": dtype_name, "torch_dtype": dtype_name}
    if a.model_type == "llama":
        config.update(attention_bias=a.qkv_bias, mlp_bias=False)
    elif a.model_type == "qwen2":
        config.update(use_sliding_window=a.sliding_window is not None, sliding_window=a.sliding_window)
    else:
        config.update(sliding_window=a.sliding_window)
    return config


def save_llama(model: Llama, out: str | os.PathLike, *, tokenizer_file: str | None = None, dtype: str | None = None) -> str:
    """Write `model` to the new Hugging Face folder `out` (config.json, model.safetensors, tokenizer.json
    where `tokenizer_file` is given) with its tensors in `dtype` ("float32", "float16", "bfloat16"; None:
    the model's `weights_dtype`, float32 where it has none); returns the folder's path."""
    name = dtype or getattr(model, "weights_dtype", "float32")
    if name not in DTYPES:
        raise ValueError(f"dtype={name!r} is not one save_hf writes; give one of {', '.join(map(repr, DTYPES))}.")
    check_tokenizer_file(tokenizer_file)

    def write(staging: str) -> None:
        save_safetensors(llama_state_dict(model, DTYPES[name]), os.path.join(staging, WEIGHTS), {"format": "pt"})
        write_json(os.path.join(staging, CONFIG), llama_config(model, name))
        copy_tokenizer(tokenizer_file, staging)

    return write_folder(out, write)


__all__ = ["DTYPES", "llama_config", "llama_state_dict", "save_llama"]
