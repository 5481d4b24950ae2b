"""Text generation with jdp's GPT and Llama family: a key/value cache and one compiled decode loop.

`generate(model, prompts, max_new_tokens, ...)` continues a batch of prompts of different lengths.
The prompts are left-padded to the longest; each row's tokens take positions 0, 1, ... from its
own first token and its attention never sees its padding, so a row continues exactly as it would
alone. The cache holds every layer's keys and values, (n_layers, batch, slots, heads, head_dim) in
the compute dtype: the prompt is run once through the model (filling its slots), then each new token
is one call of the model on that token alone, inside one `jax.lax.fori_loop` under `jax.jit`.

The cached forward pass (`forward_cached`) uses the GPT's own layers and params, unscanned or
scanned (its stacked layers run in one `lax.scan`, the cache's layer axis scanned with them); the
GPT's `__call__`, which training runs, is not changed by it. `greedy_reference` is the check: it
runs the whole forward pass for every new token, and greedy decoding (`temperature=0`) gives the
same tokens.

Sampling: logits / temperature, then top-k (keep the k largest), then top-p (keep the smallest set
of the most likely tokens whose probabilities sum to at least top_p), then one draw per row from
`jax.random.categorical`, with the key `fold_in(key, i)` for new token i: the same key gives the
same tokens.
"""
from __future__ import annotations

import math
from functools import partial
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


class KVCache(NamedTuple):
    """Every layer's attention keys and values, one slot per position: (n_layers, batch, slots, heads, head_dim)."""

    k: jax.Array
    v: jax.Array


def _layers(model):
    """The GPT's blocks as one module per layer (unscanned) or the stacked module (scanned)."""
    return model.layers if model.scan_layers else model.blocks[0]


def _gpt_cache_dims(model) -> tuple[int, int, jnp.dtype]:
    attn = _layers(model).attn
    return attn.num_heads, attn.head_dim, jnp.dtype(attn.dtype or jnp.float32)


def _cached(model) -> tuple[Callable, Callable]:
    """The model's (cache_dims, forward_cached): one entry per architecture that `generate` decodes."""
    from jdp.models.decode_llama import llama_cache_dims, llama_forward_cached  # the Llama imports nothing of this
    from jdp.models.llama import Llama

    if isinstance(model, Llama):
        return llama_cache_dims, llama_forward_cached
    return _gpt_cache_dims, _gpt_forward_cached


def init_cache(model, batch: int, slots: int) -> KVCache:
    """An empty (zero) cache for `batch` rows of `slots` positions, in the attention's compute dtype:
    (n_layers, batch, slots, heads, head_dim) for a GPT, kv_heads for a Llama (`jdp.models.decode_llama`)."""
    heads, head_dim, dtype = _cached(model)[0](model)
    shape = (model.n_layers, batch, slots, heads, head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def _block_cached(block, x, cache: KVCache, layer, start, visible):
    """One Block (eval mode) on x (b, L, d_model) at slots start..start+L-1 of layer `layer` (an int or an
    int32 scalar): writes its keys and values into the stacked `cache` in place (one (1, b, L, heads,
    head_dim) slice each) and attends to that layer's `visible` (b, L, slots) slots.

    Writing the slice into the whole (n_layers, ...) cache, not into a layer's copy that is then
    stacked again, lets XLA update the loop's cache buffer in place: a token costs its own keys and
    values, not a copy of every layer's cache.
    """
    attn = block.attn
    h = block.ln1(x)
    query, key, value = attn.query(h), attn.key(h), attn.value(h)
    at = (layer, 0, start, 0, 0)
    k = jax.lax.dynamic_update_slice(cache.k, key[None].astype(cache.k.dtype), at)
    v = jax.lax.dynamic_update_slice(cache.v, value[None].astype(cache.v.dtype), at)
    layer_k = jax.lax.dynamic_index_in_dim(k, layer, keepdims=False)  # (b, slots, heads, head_dim)
    layer_v = jax.lax.dynamic_index_in_dim(v, layer, keepdims=False)
    out = nnx.dot_product_attention(query, layer_k, layer_v, mask=visible[:, None], dtype=attn.dtype,
                                    precision=attn.precision)
    x = x + attn.out(out)
    return x + block.mlp(x), KVCache(k, v)


def forward_cached(model, tokens: jax.Array, cache: KVCache, start, first: jax.Array) -> tuple:
    """The model (a GPT or a Llama, eval mode) on `tokens` (b, L) int32 placed at slots start..start+L-1 of
    `cache`.

    `first` (b,) int32: the slot of each row's first real token (its left padding ends there). A
    token at slot s of row r takes position s - first[r] and attends to the slots first[r]..s.
    Returns (logits (b, L, vocab_size) float32, the cache with these slots written in place: each
    layer writes its (b, L, heads, head_dim) keys and values, nothing else of the cache is copied).
    """
    slots = start + jnp.arange(tokens.shape[1])
    keys = jnp.arange(cache.k.shape[2])
    visible = (keys <= slots[:, None])[None] & (keys[None, None] >= first[:, None, None])
    visible |= (keys == slots[:, None])[None]  # a padding slot sees itself: its softmax has a term
    return _cached(model)[1](model, tokens, cache, start, first, visible)


def _gpt_forward_cached(model, tokens: jax.Array, cache: KVCache, start, first: jax.Array, visible) -> tuple:
    """`forward_cached` for a GPT: learned positions s - first[r], the GPT's own blocks."""
    slots = start + jnp.arange(tokens.shape[1])
    positions = jnp.maximum(slots[None, :] - first[:, None], 0)
    x = model.tok_embed(tokens) + model.pos_embed(positions)
    if model.scan_layers:
        graphdef, stack = nnx.split(model.layers)

        def body(carry, layer):  # the whole cache rides in the carry: each layer updates its slice in place
            x, cache = carry
            params, i = layer
            x, cache = _block_cached(nnx.merge(graphdef, params), x, cache, i, start, visible)
            return (x, cache), None

        (x, cache), _ = jax.lax.scan(body, (x, cache), (stack, jnp.arange(model.n_layers)))
    else:
        for i, block in enumerate(model.blocks):
            x, cache = _block_cached(block, x, cache, i, start, visible)
    return model.logits(x), cache


def filter_logits(logits: jax.Array, top_k, top_p) -> jax.Array:
    """`logits` (b, V) with the tokens outside top-k and then outside top-p set to -inf.

    top_k: an int32 scalar in 1..V (V: none removed); top_p: a float scalar in (0, 1] (1: none
    removed). Top-p keeps, per row, the most likely tokens up to and including the first whose
    cumulative probability reaches top_p, so the most likely token always stays.
    """
    ranked = jnp.sort(logits, axis=-1)[:, ::-1]  # (b, V), largest first
    kth = jnp.take_along_axis(ranked, jnp.broadcast_to(top_k - 1, (logits.shape[0], 1)), axis=-1)
    logits = jnp.where(logits < kth, -jnp.inf, logits)
    ranked = jnp.where(jnp.arange(ranked.shape[1]) < top_k, ranked, -jnp.inf)
    probs = jax.nn.softmax(ranked, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # probability of the tokens ranked above each one
    kept = (before < top_p) | (top_p >= 1.0)
    cut = jnp.min(jnp.where(kept, ranked, jnp.inf), axis=-1, keepdims=True)  # the least likely kept logit
    return jnp.where(logits < cut, -jnp.inf, logits)


def pick(logits: jax.Array, key, temperature, top_k, top_p) -> jax.Array:
    """One token per row of `logits` (b, V): the argmax where temperature is 0, else a draw from
    softmax(filter_logits(logits / temperature)) with `key`. Returns (b,) int32."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)
    drawn = jax.random.categorical(key, filter_logits(scaled, top_k, top_p), axis=-1).astype(jnp.int32)
    return jnp.where(temperature > 0, drawn, greedy)


@partial(jax.jit, static_argnums=(0, 6))
def _decode(graphdef, state, prompt, first, key, knobs, new_tokens: int):
    """New tokens (b, new_tokens) int32 after `prompt` (b, P), left-padded up to `first` (b,)."""
    model = nnx.merge(graphdef, state)
    temperature, top_k, top_p = knobs
    b, p = prompt.shape
    cache = init_cache(model, b, p + new_tokens - 1)
    logits, cache = forward_cached(model, prompt, cache, 0, first)
    out = jnp.zeros((b, new_tokens), jnp.int32)
    out = out.at[:, 0].set(pick(logits[:, -1], jax.random.fold_in(key, 0), temperature, top_k, top_p))

    def step(i, carry):
        out, cache = carry
        previous = jax.lax.dynamic_slice_in_dim(out, i - 1, 1, axis=1)  # (b, 1): the token just drawn
        logits, cache = forward_cached(model, previous, cache, p + i - 1, first)
        token = pick(logits[:, 0], jax.random.fold_in(key, i), temperature, top_k, top_p)
        return out.at[:, i].set(token), cache

    return jax.lax.fori_loop(1, new_tokens, step, (out, cache))[0]


def _as_rows(prompts) -> list[np.ndarray]:
    """The prompts as a list of 1-D int arrays: a (b, P) array, or a sequence of sequences of ids."""
    if isinstance(prompts, (np.ndarray, jax.Array)):
        a = np.asarray(prompts)
        if a.ndim != 2:
            raise ValueError(f"prompts of shape {a.shape}: give a (batch, length) array of token ids or a list "
                             f"of lists of ids.")
        return list(a)
    if not isinstance(prompts, Sequence) or not prompts or isinstance(prompts[0], (int, np.integer)):
        raise ValueError("prompts must be a non-empty list of token-id lists (one per row), or a (batch, length) "
                         "array; for one prompt, pass [ids].")
    return [np.asarray(row) for row in prompts]


def check_prompts(rows: list[np.ndarray], vocab_size: int, context: int, max_new_tokens: int) -> None:
    """Refuse (ValueError, one sentence) an empty prompt, a non-integer or out-of-vocabulary id, or a
    prompt that with `max_new_tokens` needs more positions than the model's context."""
    for r, row in enumerate(rows):
        if row.ndim != 1 or row.size == 0:
            raise ValueError(f"prompt {r} has shape {row.shape}; each prompt needs at least one token id.")
        if row.dtype.kind not in "iu":
            raise ValueError(f"prompt {r} holds {row.dtype} values; token ids are integers 0..{vocab_size - 1}.")
        if row.min() < 0 or row.max() >= vocab_size:
            bad = int(row.min() if row.min() < 0 else row.max())
            raise ValueError(f"prompt {r} holds the token id {bad}; the model's vocabulary is 0..{vocab_size - 1}.")
    longest = max(len(row) for row in rows)
    if longest + max_new_tokens - 1 > context:
        raise ValueError(f"a prompt of {longest} tokens and {max_new_tokens} new tokens need {longest + max_new_tokens - 1} "
                         f"positions, more than the model's context of {context}; give at most "
                         f"{max(context - longest + 1, 0)} new tokens or a shorter prompt.")


def check_sampling(max_new_tokens: int, temperature: float, top_k: int | None, top_p: float | None,
                   vocab_size: int) -> None:
    """Refuse (ValueError, one sentence) max_new_tokens < 1, a negative or non-finite temperature,
    top_k < 1, or top_p outside (0, 1]."""
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer of at least 1.")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature={temperature} must be 0 (greedy) or positive.")
    if top_k is not None and (not isinstance(top_k, (int, np.integer)) or top_k < 1):
        raise ValueError(f"top_k={top_k!r} must be an integer of at least 1 (or None: every token).")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p={top_p} must be in (0, 1] (1 or None: every token).")


def _prepared(model, prompts, max_new_tokens, temperature, top_k, top_p, key) -> tuple:
    """`_decode`'s arguments for `generate`'s, checked (ValueError in one sentence)."""
    vocab, context = model.vocab_size, model.context
    check_sampling(max_new_tokens, temperature, top_k, top_p, vocab)
    rows = _as_rows(prompts)
    check_prompts(rows, vocab, context, max_new_tokens)
    longest = max(len(row) for row in rows)
    padded = np.zeros((len(rows), longest), np.int32)
    first = np.array([longest - len(row) for row in rows], np.int32)
    for r, row in enumerate(rows):
        padded[r, first[r]:] = row
    graphdef, state = nnx.split(model)
    knobs = (jnp.float32(temperature), jnp.int32(min(top_k or vocab, vocab)), jnp.float32(top_p or 1.0))
    key = jax.random.key(0) if key is None else key
    return graphdef, state, padded, first, key, knobs, int(max_new_tokens)


def generate(model, prompts, max_new_tokens: int, *, temperature: float = 1.0, top_k: int | None = None,
             top_p: float | None = None, key: jax.Array | None = None) -> np.ndarray:
    """Continue each prompt by `max_new_tokens` tokens with `model` (a `jdp.models.GPT` or `Llama`, eval mode).

    `prompts`: a list of token-id lists of any lengths (one per row), or a (batch, P) int array.
    `temperature=0` is greedy (the argmax at each step: the tokens `greedy_reference` gives);
    above 0, tokens are drawn from softmax(logits / temperature) restricted to the `top_k` most
    likely (None: all) and to the top-p nucleus (None or 1: all), with `key` (default
    `jax.random.key(0)`; the same key gives the same tokens). The longest prompt P and N new tokens
    need P + N - 1 ≤ the model's context. Returns (batch, max_new_tokens) int32 numpy: the new
    tokens only. Compiled once per (model structure, batch, P, N): a second call with other prompts of
    the same shape, temperature, top-k, top-p or key reuses it. ValueError (one sentence) for a
    negative temperature, top_k < 1, top_p outside (0, 1], max_new_tokens < 1, an empty prompt, an
    id outside the vocabulary, or a prompt too long for the context.
    """
    return np.asarray(_decode(*_prepared(model, prompts, max_new_tokens, temperature, top_k, top_p, key)))


def compiled_generate(model, prompts, max_new_tokens: int, *, temperature: float = 1.0, top_k: int | None = None,
                      top_p: float | None = None, key: jax.Array | None = None) -> Callable[[], np.ndarray]:
    """`generate(...)` with its arguments, compiled now: calling the result decodes (and returns what
    `generate` returns), so a timer around the call leaves the compilation out."""
    graphdef, state, *dynamic, new_tokens = _prepared(model, prompts, max_new_tokens, temperature, top_k, top_p, key)
    compiled = _decode.lower(graphdef, state, *dynamic, new_tokens).compile()
    return lambda: np.asarray(compiled(state, *dynamic))


@partial(jax.jit, static_argnums=(0,))
def _full_forward_last(graphdef, state, tokens, length):
    """Logits (b, V) at position length - 1 of the whole forward pass of `tokens` (b, context)."""
    logits = nnx.merge(graphdef, state)(tokens, train=False)
    return logits[:, length - 1]


def greedy_reference(model, prompts, max_new_tokens: int) -> np.ndarray:
    """Greedy continuation without a cache: for every new token, the whole forward pass of the GPT
    (`model(tokens, train=False)`) over each row's prompt and the tokens so far, alone (no padding),
    and the argmax at its last position. Slow (one full pass per token and row); the check of
    `generate(..., temperature=0)`, which gives the same (batch, max_new_tokens) int32 tokens.

    The rows are run zero-padded on the right to the model's context, one compilation for all
    lengths: position t of a causal model depends on tokens 0..t only.
    """
    vocab, context = model.vocab_size, model.context
    check_sampling(max_new_tokens, 0.0, None, None, vocab)
    rows = _as_rows(prompts)
    check_prompts(rows, vocab, context, max_new_tokens)
    graphdef, state = nnx.split(model)
    out = np.zeros((len(rows), max_new_tokens), np.int32)
    for r, row in enumerate(rows):
        tokens = list(int(t) for t in row)
        for i in range(max_new_tokens):
            window = np.zeros((1, context), np.int32)
            window[0, :len(tokens)] = tokens
            logits = _full_forward_last(graphdef, state, window, len(tokens))
            tokens.append(int(np.argmax(np.asarray(logits)[0])))
            out[r, i] = tokens[-1]
    return out


__all__ = ["KVCache", "compiled_generate", "filter_logits", "forward_cached", "generate", "greedy_reference", "init_cache", "pick"]
