"""Tiny random Llama-family checkpoints that transformers itself builds and saves, for the tests.

Four architectures (the issue's): Llama tied with grouped-query attention; Llama untied with llama3 rope
scaling, rope_theta 500000, head_dim ≠ hidden / heads and attention biases; Qwen2 (q/k/v biases, one
kv head); Mistral without a sliding window. Every 1-D param (RMSNorm weights start at 1, biases at 0) is
moved off its initial value so that a dropped, swapped or transposed tensor changes the logits, and
rms_norm_eps differs per architecture and is large in two, so that an ignored epsilon shows.
"""
from __future__ import annotations

import numpy as np

VOCAB, POSITIONS = 320, 32
COMMON = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=72, num_hidden_layers=2,
              max_position_embeddings=POSITIONS, bos_token_id=None, eos_token_id=None, pad_token_id=None)
KINDS = {
    "llama_tied_gqa": ("LlamaConfig", "LlamaForCausalLM",
                       dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, rms_norm_eps=0.1)),
    "llama_untied_llama3": ("LlamaConfig", "LlamaForCausalLM",
                            dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
                                 attention_bias=True, rms_norm_eps=1e-5, rope_theta=500000.0,
                                 rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8})),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True, rms_norm_eps=0.05,
                   rope_theta=1000.0, use_sliding_window=False)),
    "mistral": ("MistralConfig", "MistralForCausalLM",
                dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, rms_norm_eps=1e-6,
                     sliding_window=None)),
}


def hf_model(kind: str, seed: int = 0):
    """A random-weight transformers causal LM of `kind` (eval mode), its 1-D params perturbed."""
    import torch
    import transformers

    config_class, model_class, options = KINDS[kind]
    config = getattr(transformers, config_class)(**COMMON, **options)
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.3 * torch.randn_like(p))
    return model


def hf_logits(model, ids) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor(np.asarray(ids), dtype=torch.long)).logits.float().numpy()


IDS = np.random.default_rng(1).integers(0, VOCAB, (2, POSITIONS))
