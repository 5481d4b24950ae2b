"""The Llama family's cached forward pass for `jdp.models.generate` (`jdp.models.decode`).

The cache holds each layer's rotated keys and its values for the kv heads only, (n_layers, batch,
slots, kv_heads, head_dim) in the compute dtype: grouped-query attention reads kv head h // (heads /
kv_heads) for query head h (`jdp.models.llama.grouped_attention`), so repeating the kv heads to the query
heads would cost heads / kv_heads times the memory and bandwidth for the same numbers. Keys are stored
rotated at their own position, as transformers' cache stores them, so a new token rotates only its own
query and key.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jdp.models.llama import Llama, LlamaBlock, grouped_attention


def llama_cache_dims(model: Llama) -> tuple[int, int, jnp.dtype]:
    """(kv_heads, head_dim, dtype) of one cache slot: the kv heads, not the query heads."""
    return model.arch.n_kv_heads, model.arch.head_dim, jnp.dtype(model.dtype)


def _block_cached(block: LlamaBlock, x, cos, sin, cache, layer, start, visible):
    """One LlamaBlock (eval mode) on x (b, L, d_model) at slots start..start+L-1 of layer `layer`: writes
    its rotated keys and its values (1, b, L, kv_heads, head_dim) into the stacked cache in place and
    attends to that layer's `visible` (b, L, slots) slots."""
    attn = block.attn
    q, k, v = attn.project(block.attn_norm(x), cos, sin)
    at = (layer, 0, start, 0, 0)
    keys = jax.lax.dynamic_update_slice(cache.k, k[None].astype(cache.k.dtype), at)
    values = jax.lax.dynamic_update_slice(cache.v, v[None].astype(cache.v.dtype), at)
    layer_k = jax.lax.dynamic_index_in_dim(keys, layer, keepdims=False)  # (b, slots, kv_heads, head_dim)
    layer_v = jax.lax.dynamic_index_in_dim(values, layer, keepdims=False)
    out = grouped_attention(q, layer_k.astype(q.dtype), layer_v.astype(q.dtype), visible)
    b, length = x.shape[:2]
    x = x + attn.o_proj(out.reshape(b, length, attn.n_heads * attn.head_dim))
    return x + block.mlp(x), type(cache)(keys, values)


def llama_forward_cached(model: Llama, tokens: jax.Array, cache, start, first: jax.Array, visible: jax.Array) -> tuple:
    """The Llama (eval mode) on `tokens` (b, L) int32 at slots start..start+L-1 of `cache`, row r's token at
    slot s taking position s - first[r] (its rotary angle) and attending to `visible` (b, L, slots).
    Returns (logits (b, L, vocab) float32, the cache with these slots written in place)."""
    slots = start + jnp.arange(tokens.shape[1])
    positions = jnp.maximum(slots[None, :] - first[:, None], 0)
    cos, sin = model.rotary(positions)  # (b, L, head_dim): each row's own positions
    x = model.embed(tokens)
    if model.scan_layers:
        graphdef, stack = nnx.split(model.layers)

        def body(carry, layer):  # the whole cache rides in the carry: each layer updates its slice in place
            x, cache = carry
            params, i = layer
            x, cache = _block_cached(nnx.merge(graphdef, params), x, cos, sin, cache, i, start, visible)
            return (x, cache), None

        (x, cache), _ = jax.lax.scan(body, (x, cache), (stack, jnp.arange(model.n_layers)))
    else:
        for i, block in enumerate(model.blocks):
            x, cache = _block_cached(block, x, cos, sin, cache, i, start, visible)
    return model.logits(x), cache


__all__ = ["llama_cache_dims", "llama_forward_cached"]
