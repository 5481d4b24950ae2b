"""Which reader or writer a Hugging Face folder or a jdp model takes: one entry per architecture.

`from_hf(PATH)` reads config.json's model_type and hands the folder to that architecture's reader;
`save_hf(model, OUT)` hands the model to its class's writer. A new architecture is a reader module, a
writer module and a line in each table here.
"""
from __future__ import annotations

import os

from jdp.models.hub.folder import read_config
from jdp.text import quoted


def _readers() -> dict:
    from jdp.models.hub.gpt2_in import gpt_from_hf
    from jdp.models.hub.llama_in import llama_from_hf

    return {"gpt2": gpt_from_hf, "llama": llama_from_hf, "qwen2": llama_from_hf, "mistral": llama_from_hf}


def _writers() -> dict:
    from jdp.models.gpt import GPT
    from jdp.models.hub.gpt2_out import save_gpt2
    from jdp.models.hub.llama_out import save_llama
    from jdp.models.llama import Llama

    return {GPT: save_gpt2, Llama: save_llama}


def model_type(path: str | os.PathLike) -> str:
    """config.json's model_type in the folder `path`; ValueError (one sentence) for one jdp does not read."""
    path = os.fspath(path)
    kind = read_config(path).get("model_type")
    if kind not in _readers():
        raise ValueError(f"{quoted(path)}: config.json has model_type {kind!r}; jdp reads "
                         f"{', '.join(map(repr, _readers()))}.")
    return kind


def from_hf(path: str | os.PathLike, *, dtype=None, **options):
    """The jdp model holding the Hugging Face checkpoint in folder `path` (what `save_pretrained` wrote):
    a `GPT` for model_type "gpt2" (`gpt_from_hf`), a `Llama` for "llama", "qwen2" and "mistral"
    (`llama_from_hf`; `context=` limits the positions it takes). `dtype` is the compute dtype; `options`
    (attention, dropout, remat, scan_layers) are the model's. Its float32 logits equal transformers'
    `AutoModelForCausalLM.from_pretrained(path)` to float32 rounding. ValueError (one sentence, naming the
    config key and value) for anything jdp cannot represent."""
    return _readers()[model_type(path)](path, dtype=dtype, **options)


def save_hf(model, out: str | os.PathLike, *, tokenizer_file: str | None = None, **options) -> str:
    """Write `model` (jdp's `GPT` or `Llama`) to the new Hugging Face folder `out` (config.json,
    model.safetensors, and a copy of `tokenizer_file` as tokenizer.json where given); returns its path.
    transformers' `AutoModelForCausalLM.from_pretrained(out)` computes the model's logits. Nothing is
    overwritten: ValueError (one sentence) for an `out` that is not new or an empty directory, or is a link."""
    for cls, write in _writers().items():
        if isinstance(model, cls):
            return write(model, out, tokenizer_file=tokenizer_file, **options)
    raise ValueError(f"save_hf writes jdp's GPT and Llama models (jdp.models.GPT, jdp.models.Llama), got a "
                     f"{type(model).__name__}.")


__all__ = ["from_hf", "model_type", "save_hf"]
