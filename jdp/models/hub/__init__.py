"""Checkpoint formats in and out of jdp's models, apart from the models themselves.

Hugging Face folders (config.json + safetensors), one module per architecture and direction:
`gpt2_in`/`gpt2_out` (jdp's GPT as GPT-2), `llama_in`/`llama_out` (jdp's Llama as "llama", "qwen2" or
"mistral"); `formats` picks the module by config.json's model_type (`from_hf`) or by the model's class
(`save_hf`). `folder` reads and writes what every architecture shares (config.json, shards, a folder
written without overwriting), `safetensors_io` the safetensors format with numpy alone, `weights` puts
converted arrays into a model. `nanogpt` takes a nanoGPT state dict.
"""
from jdp.models.hub.formats import from_hf, save_hf
from jdp.models.hub.gpt2_in import gpt_from_hf
from jdp.models.hub.nanogpt import gpt_from_nanogpt

__all__ = ["from_hf", "gpt_from_hf", "gpt_from_nanogpt", "save_hf"]
