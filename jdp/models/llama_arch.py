"""What a Llama-family model is: the sizes and options of `jdp.models.Llama`, as one checked value.

The fields are Hugging Face `LlamaConfig`'s (and Qwen2's and Mistral's, which are the same architecture
with other defaults) in jdp's words; `jdp.models.hub.llama_in` reads them from config.json and
`jdp.models.hub.llama_out` writes them back.
"""
from __future__ import annotations

from dataclasses import dataclass

from jdp.models.rope import RopeScaling

MODEL_TYPES = ("llama", "qwen2", "mistral")


@dataclass(frozen=True)
class LlamaArchitecture:
    """A Llama-family decoder: RMSNorm, rotary attention with grouped-query heads, a SwiGLU MLP.

    Attention has `n_heads` query heads and `n_kv_heads` key/value heads (n_heads a multiple of it: each
    kv head serves n_heads / n_kv_heads consecutive query heads), each `head_dim` wide (which may differ
    from d_model / n_heads). `context` is the positions the model takes (max_position_embeddings).
    """

    vocab_size: int
    context: int  # max_position_embeddings
    d_model: int  # hidden_size
    n_layers: int  # num_hidden_layers
    n_heads: int  # num_attention_heads
    n_kv_heads: int  # num_key_value_heads
    head_dim: int
    d_ff: int  # intermediate_size: the SwiGLU MLP's width
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_embeddings: bool = False  # tie_word_embeddings: logits = x @ embed.T, no head
    qkv_bias: bool = False  # biases on the q/k/v projections (Llama's attention_bias, Qwen2: always)
    out_bias: bool = False  # a bias on the output projection (Llama's attention_bias; Qwen2: never)
    model_type: str = "llama"  # "llama", "qwen2" or "mistral": how config.json names it (same computation)
    sliding_window: int | None = None  # Mistral/Qwen2; a `Llama` takes at most this many positions
    bos_token_id: int | None = None  # config.json's, kept for export; no effect on the computation
    eos_token_id: int | tuple[int, ...] | None = None

    def __post_init__(self):
        sizes = dict(vocab_size=self.vocab_size, context=self.context, d_model=self.d_model, n_layers=self.n_layers,
                     n_heads=self.n_heads, n_kv_heads=self.n_kv_heads, head_dim=self.head_dim, d_ff=self.d_ff)
        bad = [f"{k}={v!r}" for k, v in sizes.items() if isinstance(v, bool) or not isinstance(v, int) or v < 1]
        if bad:
            raise ValueError(f"LlamaArchitecture: {', '.join(bad)} must be positive integers.")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads} (each "
                             f"key/value head serves a whole group of query heads).")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even: rotary embeddings turn pairs of its elements.")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps={self.rms_norm_eps} must be positive.")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta={self.rope_theta} must be positive.")
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"model_type={self.model_type!r} is not one of {MODEL_TYPES}.")
        if self.sliding_window is not None and (isinstance(self.sliding_window, bool) or self.sliding_window < 1):
            raise ValueError(f"sliding_window={self.sliding_window!r} must be a positive integer or None.")

    @property
    def groups(self) -> int:
        """Query heads per key/value head."""
        return self.n_heads // self.n_kv_heads


__all__ = ["MODEL_TYPES", "LlamaArchitecture"]
