"""A small GPT-style causal transformer (Flax NNX).

Dropout randomness is an argument of every call, never state of the module: the Dropout layers
are built without `rngs`, and `GPT.__call__(tokens, train=True, rngs=nnx.Rngs(dropout=key))`
supplies the key. jdp splits and merges the module fresh inside each jitted step, so an RNG
counter stored in the module would make the masks depend on host-side state; with the key
passed in, a mask is a function of the key alone (jdp derives one per (seed, micro-step,
device) with `jdp.state.device_key`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

_EMBED_INIT = nnx.initializers.normal(stddev=0.02)


def _dropout_rngs(rngs: nnx.Rngs | jax.Array | None, train: bool, rate: float) -> nnx.Rngs | None:
    """The Rngs the dropout layers draw from: needed only when dropout is on."""
    if not train or rate == 0.0:
        return None
    if rngs is None:
        raise ValueError("GPT(train=True) with dropout > 0 needs a key: pass rngs=nnx.Rngs(dropout=key).")
    if isinstance(rngs, jax.Array):
        return nnx.Rngs(dropout=rngs)
    return rngs


class Block(nnx.Module):
    """Pre-LayerNorm transformer block: x + drop(attn(ln(x))), then x + drop(mlp(ln(x))).

    (batch, T, d_model) → (batch, T, d_model); attention is causal (position t sees ≤ t).
    """

    def __init__(self, d_model: int, n_heads: int, dropout: float, *, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(d_model, rngs=rngs)
        # Attention-weight dropout off (dropout_rate=0.0), so the layer keeps no RNG stream;
        # dropout is applied to its output below, with the key given at call time.
        self.attn = nnx.MultiHeadAttention(n_heads, d_model, dropout_rate=0.0, decode=False,
                                           keep_rngs=False, rngs=rngs)
        self.drop1 = nnx.Dropout(dropout)
        self.ln2 = nnx.LayerNorm(d_model, rngs=rngs)
        self.fc = nnx.Linear(d_model, 4 * d_model, rngs=rngs)
        self.proj = nnx.Linear(4 * d_model, d_model, rngs=rngs)
        self.drop2 = nnx.Dropout(dropout)

    def __call__(self, x: jax.Array, mask: jax.Array, *, train: bool, rngs: nnx.Rngs | None) -> jax.Array:
        """x (batch, T, d_model), mask (batch, 1, T, T) bool → (batch, T, d_model)."""
        h = self.attn(self.ln1(x), mask=mask, deterministic=True)
        x = x + self.drop1(h, deterministic=not train, rngs=rngs)
        h = self.proj(nnx.gelu(self.fc(self.ln2(x))))
        return x + self.drop2(h, deterministic=not train, rngs=rngs)


class GPT(nnx.Module):
    """Token + learned position embeddings, `n_layers` causal blocks, final LayerNorm, linear head.

    Input int32 tokens (batch, T) with T ≤ context; output float32 logits (batch, T, vocab_size),
    where position t depends only on tokens[:, :t + 1].
    """

    def __init__(self, vocab_size: int, context: int, d_model: int = 64, n_heads: int = 4, n_layers: int = 2,
                 dropout: float = 0.1, *, rngs: nnx.Rngs):
        if min(vocab_size, context, d_model, n_heads, n_layers) < 1:
            raise ValueError(f"vocab_size={vocab_size}, context={context}, d_model={d_model}, n_heads={n_heads} "
                             f"and n_layers={n_layers} must all be positive.")
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} must be divisible by n_heads={n_heads}.")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout={dropout} must be in [0, 1).")
        self.context, self.dropout = int(context), float(dropout)
        self.tok_embed = nnx.Embed(vocab_size, d_model, embedding_init=_EMBED_INIT, rngs=rngs)
        self.pos_embed = nnx.Embed(context, d_model, embedding_init=_EMBED_INIT, rngs=rngs)
        self.drop = nnx.Dropout(dropout)
        self.blocks = nnx.List([Block(d_model, n_heads, dropout, rngs=rngs) for _ in range(n_layers)])
        self.ln_f = nnx.LayerNorm(d_model, rngs=rngs)
        self.head = nnx.Linear(d_model, vocab_size, use_bias=False, rngs=rngs)

    def __call__(self, tokens: jax.Array, *, train: bool = True,
                 rngs: nnx.Rngs | jax.Array | None = None) -> jax.Array:
        """int32 (batch, T) → (batch, T, vocab_size) logits.

        train=True applies dropout (embeddings, attention output, MLP output) with masks drawn
        from `rngs` (an `nnx.Rngs` with a "dropout" stream, or a bare key); it is required when
        dropout > 0. train=False is deterministic and needs no key.
        """
        if tokens.ndim != 2:
            raise ValueError(f"tokens must have shape (batch, T), got {tokens.shape}.")
        t = tokens.shape[1]
        if t > self.context:
            raise ValueError(f"sequence length {t} exceeds the model's context of {self.context}.")
        rngs = _dropout_rngs(rngs, train, self.dropout)
        x = self.tok_embed(tokens) + self.pos_embed(jnp.arange(t))
        x = self.drop(x, deterministic=not train, rngs=rngs)
        mask = nnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block(x, mask, train=train, rngs=rngs)
        return self.head(self.ln_f(x))
