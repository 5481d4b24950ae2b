"""Hugging Face Llama-family checkpoints in jdp's `Llama`: the same model, so the same logits and training.

A folder `save_pretrained` wrote for `LlamaForCausalLM`, `Qwen2ForCausalLM` or `MistralForCausalLM`
(model_type "llama", "qwen2", "mistral"): config.json and model.safetensors, or its shards with
model.safetensors.index.json; float32, float16 or bfloat16 tensors, read one at a time into float32 params.

How the config maps (`read_llama_architecture`): the sizes; `head_dim` (null: hidden_size /
num_attention_heads); `num_key_value_heads` (absent: as many as the query heads); rope theta and scaling
from `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (older files), of rope_type
default, "linear" or "llama3"; Llama's `attention_bias` (q, k, v and o biases) or Qwen2's q/k/v biases;
a sliding window (Mistral, Qwen2's `use_sliding_window`) only where it covers every position the model
will take. Whatever else jdp's Llama cannot compute is a ValueError naming the key and its value.

How the weights map: torch's Linear stores (out, in), nnx's (in, out), so every projection is
transposed; the rest (embedding (vocab, d_model), RMSNorm weights) is as it is. A tied checkpoint
stores no `lm_head.weight` (or an equal copy, which is checked).
"""
from __future__ import annotations

import os
import re

import numpy as np

from jdp.models.hub.folder import checkpoint_tensors, read_config
from jdp.models.hub.weights import build_model, install_params
from jdp.models.llama import Llama
from jdp.models.llama_arch import MODEL_TYPES, LlamaArchitecture
from jdp.models.rope import SCALINGS, RopeScaling
from jdp.text import quoted

CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
# config.json keys with the only value jdp's Llama computes (absent: that value).
FIXED = {"hidden_act": "silu", "mlp_bias": False, "attention_dropout": 0.0, "partial_rotary_factor": 1.0}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)$")
# A layer's tensors: HF's name after "model.layers.N." → (jdp's path inside the block, transposed?).
LAYER_TENSORS = {"input_layernorm.weight": (("attn_norm", "scale"), False),
                 "post_attention_layernorm.weight": (("mlp_norm", "scale"), False),
                 **{f"self_attn.{p}_proj.weight": (("attn", f"{p}_proj", "kernel"), True) for p in "qkvo"},
                 **{f"self_attn.{p}_proj.bias": (("attn", f"{p}_proj", "bias"), False) for p in "qkvo"},
                 **{f"mlp.{p}_proj.weight": ((f"{p}_proj", "kernel"), True) for p in ("gate", "up", "down")}}


def _number(config: dict, key: str, where: str, default=None, integer=True):
    value = config.get(key, default)
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or value <= 0:
        what = "a positive integer" if integer else "a positive number"
        raise ValueError(f"{where}: config.json has {key}={value!r}, where {what} belongs.")
    return value


def _rope(config: dict, where: str) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from rope_parameters (transformers 5) or rope_theta + rope_scaling."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    key = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
    if not isinstance(params, dict):
        raise ValueError(f"{where}: config.json has {key}={params!r}, where an object belongs.")
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    theta = _number({"rope_theta": theta}, "rope_theta", where, integer=False)
    if params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"{where}: config.json has partial_rotary_factor={params.get('partial_rotary_factor')!r}; "
                         f"jdp's Llama rotates the whole head (1.0).")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return float(theta), None
    if kind not in SCALINGS:
        raise ValueError(f"{where}: config.json has {key} of rope_type {kind!r}, which jdp's Llama does not "
                         f"compute; it computes the default rotary embedding, {', '.join(map(repr, SCALINGS))}.")
    try:
        if kind == "linear":
            return float(theta), RopeScaling("linear", float(params["factor"]))
        return float(theta), RopeScaling("llama3", float(params["factor"]), float(params["low_freq_factor"]),
                                         float(params["high_freq_factor"]),
                                         int(params.get("original_max_position_embeddings",
                                                        config.get("max_position_embeddings"))))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{where}: config.json's {key} of rope_type {kind!r} is incomplete or wrong ({e}).") from None


def _window(config: dict, model_type: str) -> int | None:
    """The sliding window config.json sets (None: every layer attends to every earlier position): Mistral's
    sliding_window, Qwen2's where use_sliding_window is true; Llama has none."""
    if model_type == "llama" or (model_type == "qwen2" and not config.get("use_sliding_window")):
        return None
    window = config.get("sliding_window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"config.json has sliding_window={window!r}, where a positive integer or null belongs.")
    return window


def read_llama_architecture(path: str, config: dict | None = None, context: int | None = None) -> LlamaArchitecture:
    """The architecture in `path`/config.json (or `config`, that file as read) for a model that takes
    `context` positions (None: max_position_embeddings). ValueError (one sentence, naming the key and value)
    for another model_type or an option jdp's Llama cannot compute."""
    config = read_config(path) if config is None else config
    where, model_type = quoted(path), config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"{where}: config.json has model_type {model_type!r}; jdp reads 'gpt2' and the Llama family "
                         f"{', '.join(map(repr, MODEL_TYPES))}.")
    for key, needed in FIXED.items():
        if config.get(key, needed) != needed:
            raise ValueError(f"{where}: config.json has {key}={config[key]!r}; jdp's Llama computes only "
                             f"{key}={needed!r}.")
    sizes = {k: _number(config, k, where) for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                    "num_hidden_layers", "num_attention_heads", "max_position_embeddings")}
    heads = sizes["num_attention_heads"]
    kv_heads = _number(config, "num_key_value_heads", where, default=heads)
    head_dim = config.get("head_dim") or sizes["hidden_size"] // heads
    positions = sizes["max_position_embeddings"]
    if context is not None and not 1 <= context <= positions:
        raise ValueError(f"context={context} must be in 1..{positions} (config.json's max_position_embeddings).")
    theta, scaling = _rope(config, where)
    bias = bool(config.get("attention_bias", False)) if model_type == "llama" else model_type == "qwen2"
    eos = config.get("eos_token_id")
    return LlamaArchitecture(
        vocab_size=sizes["vocab_size"], context=positions, d_model=sizes["hidden_size"],
        n_layers=sizes["num_hidden_layers"], n_heads=heads, n_kv_heads=kv_heads, head_dim=head_dim,
        d_ff=sizes["intermediate_size"], rms_norm_eps=float(_number(config, "rms_norm_eps", where, 1e-6, False)),
        rope_theta=theta, rope_scaling=scaling, tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=bias, out_bias=bias and model_type == "llama", model_type=model_type,
        sliding_window=_window(config, model_type),
        bos_token_id=config.get("bos_token_id"), eos_token_id=tuple(eos) if isinstance(eos, list) else eos)


def _place(params: dict, path: tuple, value: np.ndarray) -> None:
    for key in path[:-1]:
        params = params.setdefault(key, {})
    params[path[-1]] = value


def llama_params(tensors, arch: LlamaArchitecture, where: str) -> tuple[dict, str]:
    """The (name, array) pairs of a Llama-family checkpoint → (params of an unscanned `Llama(arch)` as nested
    float32 numpy dicts, the checkpoint's float dtype name). Each tensor is converted as it comes.
    ValueError naming any missing or unknown tensor, or a tied head that differs from the embedding."""
    params, dtypes, head = {"blocks": {i: {} for i in range(arch.n_layers)}}, set(), None
    for name, value in tensors:
        bare = name[len("model."):] if name.startswith("model.") else name
        if bare.endswith("rotary_emb.inv_freq"):
            continue  # older checkpoints saved the rotary frequencies; jdp computes them from config.json
        dtypes.add(value.dtype.name)
        layer = _LAYER.match("model." + bare)
        if layer and int(layer.group(1)) < arch.n_layers and layer.group(2) in LAYER_TENSORS:
            path, transposed = LAYER_TENSORS[layer.group(2)]
            _place(params["blocks"][int(layer.group(1))], path, np.array(value.T if transposed else value, np.float32))
        elif bare == "embed_tokens.weight":
            params["embed"] = {"embedding": np.array(value, np.float32)}
        elif bare == "norm.weight":
            params["norm"] = {"scale": np.array(value, np.float32)}
        elif name == "lm_head.weight":
            head = np.array(value.T, np.float32)
        else:
            raise ValueError(f"{where}: the weights have {name!r}, which a {arch.model_type} of config.json's "
                             f"{arch.n_layers} layers (qkv bias {arch.qkv_bias}, output bias {arch.out_bias}) does not.")
    _attach_head(params, head, arch, where)
    return params, (dtypes.pop() if len(dtypes) == 1 else "float32")


def _attach_head(params: dict, head: np.ndarray | None, arch: LlamaArchitecture, where: str) -> None:
    if not arch.tie_embeddings:
        if head is None:
            raise ValueError(f"{where}: the weights lack 'lm_head.weight', which config.json's tie_word_embeddings="
                             f"false needs.")
        params["head"] = {"kernel": head}
    elif head is not None and "embed" in params and not np.array_equal(head.T, params["embed"]["embedding"]):
        raise ValueError(f"{where}: config.json ties the head to the token embedding (tie_word_embeddings), but "
                         f"lm_head.weight differs from model.embed_tokens.weight.")


def llama_from_hf(path: str | os.PathLike, *, dtype=None, attention: str = "flax", dropout: float = 0.0,
                  remat: bool = False, scan_layers: bool = False, context: int | None = None) -> Llama:
    """jdp's `Llama` holding the Hugging Face Llama/Qwen2/Mistral checkpoint in folder `path`.

    `context`: the positions the model takes (None: config.json's max_position_embeddings), e.g. the
    training window; the other options are `Llama`'s. Its float32 logits (b, T, vocab) equal
    `transformers.AutoModelForCausalLM.from_pretrained(path)(ids).logits` to float32 rounding; its
    `weights_dtype` is the checkpoint's (what `save_hf` writes back by default).
    """
    path = os.fspath(path)
    config = read_config(path)
    arch = read_llama_architecture(path, config, context)
    positions, window = context or arch.context, arch.sliding_window
    if window is not None and window < positions:
        raise ValueError(f"{quoted(path)}: config.json has sliding_window={window}, fewer than the {positions} positions "
                         f"the model would take; jdp's Llama attends to every earlier position, so give context={window} "
                         f"or less (model.context in jdp train) to stay within the window.")
    params, weights_dtype = llama_params(checkpoint_tensors(path, CLASSES[arch.model_type]), arch, quoted(path))
    model = build_model(lambda rngs: Llama(arch, dtype=dtype, attention=attention, dropout=dropout, remat=remat,
                                           scan_layers=scan_layers, context=context, rngs=rngs))
    model = install_params(model, params, quoted(path))
    model.weights_dtype = weights_dtype
    return model


__all__ = ["CLASSES", "llama_from_hf", "llama_params", "read_llama_architecture"]
