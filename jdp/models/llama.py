"""A Llama-family decoder (Llama 2/3, Qwen2, Mistral, SmolLM, TinyLlama) in Flax NNX, beside `GPT`.

Token embedding, `n_layers` pre-norm blocks, a final RMSNorm and a head (or the embedding's transpose).
Each block: x + attn(rms(x)), then x + mlp(rms(x)), with rotary attention over grouped key/value heads
and a SwiGLU MLP, down(silu(gate(h)) · up(h)). It computes what transformers' `LlamaForCausalLM`
(`Qwen2ForCausalLM`, `MistralForCausalLM`) computes: RMSNorm in float32, rotary embeddings in
`jdp.models.rope`'s layout, attention scaled by 1/sqrt(head_dim).

Conventions are GPT's: params float32; compute in `dtype` (None: float32, or bfloat16); logits float32.
`attention`: "flax" (jdp's masked softmax over grouped heads, `grouped_attention`), "fused"
(`jax.nn.dot_product_attention(is_causal=True)`: no (T, T) mask; XLA's implementation) or "cudnn"
(the same call with cuDNN flash attention: GPUs and bfloat16 only). `remat=True` rematerialises each
block; `scan_layers=True` stacks the blocks' params (leading axis n_layers) and runs them in one
`lax.scan`, gathering one layer at a time under per-layer FSDP (`jdp.fsdp.gather`). `dropout`
(0 by default, as the checkpoints were trained) drops each block's attention and MLP outputs with the
key given at call time, as GPT does.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jdp.core.global_view import pin_batch
from jdp.core.split import gather, gather_layer_axis
from jdp.models.dtypes import compute_dtype
from jdp.models.gpt import ATTENTIONS, _dropout_rngs
from jdp.models.llama_arch import LlamaArchitecture
from jdp.models.rope import inverse_frequencies, rotary_angles, rotate
from jdp.models.xent import fused_cross_entropy

_INIT = nnx.initializers.normal(stddev=0.02)  # transformers' initializer_range

class RMSNorm(nnx.Module):
    """x / sqrt(mean(x²) + eps) · scale over the last axis, computed in float32, returned in `dtype`."""

    def __init__(self, features: int, eps: float, dtype):
        self.scale = nnx.Param(jnp.ones((features,), jnp.float32))
        self.eps, self.dtype = float(eps), dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.scale[...].astype(self.dtype) * normed.astype(self.dtype)

def grouped_attention(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array) -> jax.Array:
    """Softmax attention of q (b, T, heads, hd) over k, v (b, S, kv_heads, hd), query head h reading kv head
    h // (heads / kv_heads); `visible` (b or 1, T, S) bool. Scores scaled by 1/sqrt(hd), softmax in float32.
    Returns (b, T, heads, hd) in q's dtype."""
    b, t, heads, hd = q.shape
    kv = k.shape[2]
    grouped = q.reshape(b, t, kv, heads // kv, hd)
    scores = jnp.einsum("btkgd,bskd->bkgts", grouped, k).astype(jnp.float32) / jnp.sqrt(jnp.float32(hd))
    scores = jnp.where(visible[:, None, None], scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    return jnp.einsum("bkgts,bskd->btkgd", weights, v).reshape(b, t, heads, hd)

class LlamaAttention(nnx.Module):
    """Rotary, grouped-query self-attention: (b, T, d_model) → (b, T, d_model), causal."""

    def __init__(self, arch: LlamaArchitecture, *, dtype, attention: str, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=jnp.float32, kernel_init=_INIT, rngs=rngs)
        q_dims, kv_dims = arch.n_heads * arch.head_dim, arch.n_kv_heads * arch.head_dim
        self.q_proj = nnx.Linear(arch.d_model, q_dims, use_bias=arch.qkv_bias, **kw)
        self.k_proj = nnx.Linear(arch.d_model, kv_dims, use_bias=arch.qkv_bias, **kw)
        self.v_proj = nnx.Linear(arch.d_model, kv_dims, use_bias=arch.qkv_bias, **kw)
        self.o_proj = nnx.Linear(q_dims, arch.d_model, use_bias=arch.out_bias, **kw)
        self.n_heads, self.n_kv_heads, self.head_dim = arch.n_heads, arch.n_kv_heads, arch.head_dim
        self.attention, self.dtype = attention, dtype

    def project(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x (b, T, d_model) → q (b, T, heads, hd) and k, v (b, T, kv_heads, hd), q and k rotated by cos/sin."""
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, self.n_heads, self.head_dim)
        k = self.k_proj(x).reshape(b, t, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, t, self.n_kv_heads, self.head_dim)
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        q, k, v = self.project(x, cos, sin)
        b, t = x.shape[:2]
        if self.attention == "flax":
            out = grouped_attention(q, k, v, jnp.tril(jnp.ones((1, t, t), bool)))
        else:  # jax's attention takes grouped heads as they are and applies causality itself: no (T, T) mask
            implementation = "cudnn" if self.attention == "cudnn" else None
            out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)
        return self.o_proj(out.reshape(b, t, self.n_heads * self.head_dim))

class LlamaBlock(nnx.Module):
    """x + drop(attn(rms(x))), then x + drop(mlp(x)): (b, T, d_model) → (b, T, d_model) in the compute dtype."""

    def __init__(self, arch: LlamaArchitecture, *, dtype, attention: str, dropout: float, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=jnp.float32, kernel_init=_INIT, use_bias=False, rngs=rngs)
        self.attn_norm = RMSNorm(arch.d_model, arch.rms_norm_eps, dtype)
        self.attn = LlamaAttention(arch, dtype=dtype, attention=attention, rngs=rngs)
        self.mlp_norm = RMSNorm(arch.d_model, arch.rms_norm_eps, dtype)
        self.gate_proj = nnx.Linear(arch.d_model, arch.d_ff, **kw)
        self.up_proj = nnx.Linear(arch.d_model, arch.d_ff, **kw)
        self.down_proj = nnx.Linear(arch.d_ff, arch.d_model, **kw)
        self.drop1, self.drop2 = nnx.Dropout(dropout), nnx.Dropout(dropout)

    def __call__(self, x, cos, sin, *, train: bool, rngs) -> jax.Array:
        """`rngs`: the Rngs both dropouts draw from, in order, or their two keys (shape (2,), as the scanned
        model passes them), or None when dropout is off."""
        first, second = (rngs, rngs) if rngs is None or isinstance(rngs, nnx.Rngs) else (rngs[0], rngs[1])
        x = x + self.drop1(self.attn(self.attn_norm(x), cos, sin), deterministic=not train, rngs=first)
        return x + self.drop2(self.mlp(x), deterministic=not train, rngs=second)

    def mlp(self, x: jax.Array) -> jax.Array:
        """The MLP branch with its norm, before dropout: down(silu(gate(h)) · up(h)), h = rms(x)."""
        h = self.mlp_norm(x)
        return self.down_proj(nnx.silu(self.gate_proj(h)) * self.up_proj(h))

def _block_forward(block: LlamaBlock, x, cos, sin, train: bool, rngs):
    return block(x, cos, sin, train=train, rngs=rngs)

_remat_block_forward = nnx.remat(_block_forward, static_argnums=(4,))  # `train` picks code paths

def stacked_layers(arch: LlamaArchitecture, rngs: nnx.Rngs, **kwargs) -> LlamaBlock:
    """n_layers LlamaBlocks made one after another from `rngs` (as the unscanned model makes them), as one
    module whose params have a leading axis of n_layers."""
    blocks = [LlamaBlock(arch, rngs=rngs, **kwargs) for _ in range(arch.n_layers)]
    graphdef, _ = nnx.split(blocks[0])
    return nnx.merge(graphdef, jax.tree.map(lambda *layer: jnp.stack(layer), *(nnx.state(b) for b in blocks)))

def run_stacked(layers: LlamaBlock, x, cos, sin, train: bool, rngs: nnx.Rngs | None, n_layers: int, remat: bool):
    """x (b, T, d_model) through the stacked layers, one `lax.scan` step each; the body gathers its layer's
    params (a no-op unless the model gathers its own split params) and, with `remat`, is a checkpoint.
    Dropout keys are drawn ahead, two per layer in the order the unscanned blocks draw them."""
    graphdef, stack = nnx.split(layers)
    stack = gather_layer_axis(stack)
    keys = None if rngs is None else jnp.stack([jnp.stack([rngs.dropout(), rngs.dropout()]) for _ in range(n_layers)])

    def body(x, xs):
        layer, key = xs
        return pin_batch(nnx.merge(graphdef, gather(layer))(x, cos, sin, train=train, rngs=key)), None

    return jax.lax.scan(jax.checkpoint(body) if remat else body, x, (stack, keys))[0]

class Llama(nnx.Module):
    """A Llama-family causal LM: int32 tokens (b, T), T ≤ arch.context → float32 logits (b, T, vocab_size),
    position t depending only on tokens[:, :t + 1].

    Args:
      arch: the sizes and options (`LlamaArchitecture`; `jdp.models.from_hf` reads them from config.json).
      dtype: compute dtype (None: float32; jnp.bfloat16 / "bf16"); params and logits stay float32.
      attention: "flax", "fused" or "cudnn" (module docstring); remat, scan_layers: as GPT's.
      dropout: rate of the blocks' output dropout in training, 0 by default.
      context: the positions the model takes, at most arch.context (None: arch.context); where the
        architecture has a sliding window, at most the window (then every position sees all earlier ones,
        as the windowed model computes it).
    """

    def __init__(self, arch: LlamaArchitecture, *, dtype=None, attention: str = "flax", remat: bool = False,
                 scan_layers: bool = False, dropout: float = 0.0, context: int | None = None, rngs: nnx.Rngs):
        if not isinstance(arch, LlamaArchitecture):
            raise ValueError(f"Llama takes a jdp.models.LlamaArchitecture, got a {type(arch).__name__}.")
        context = arch.context if context is None else context
        if isinstance(context, bool) or not isinstance(context, int) or not 1 <= context <= arch.context:
            raise ValueError(f"context={context!r} must be an integer in 1..{arch.context} (the architecture's "
                             f"max_position_embeddings).")
        if arch.sliding_window is not None and arch.sliding_window < context:
            raise ValueError(f"the architecture's sliding_window={arch.sliding_window} is smaller than the {context} "
                             f"positions the model would take; jdp's Llama attends to every earlier position: give "
                             f"context={arch.sliding_window} or less to stay within the window.")
        if attention not in ATTENTIONS:
            raise ValueError(f"attention={attention!r} is not one of {ATTENTIONS}.")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout={dropout} must be in [0, 1).")
        dtype = compute_dtype(dtype)
        if attention == "cudnn" and (jax.default_backend() != "gpu" or dtype != jnp.bfloat16):
            raise ValueError(f"attention='cudnn' (cuDNN flash attention) needs a GPU and dtype bfloat16; here jax "
                             f"runs on {jax.default_backend()!r} with dtype {jnp.dtype(dtype).name}: use 'fused'.")
        self.arch, self.context, self.n_layers = arch, context, arch.n_layers
        self.attention, self.remat, self.scan_layers, self.dropout = attention, bool(remat), bool(scan_layers), float(dropout)
        self.tie_embeddings, self.dtype = arch.tie_embeddings, dtype
        block_kw = dict(dtype=dtype, attention=attention, dropout=dropout)
        self.embed = nnx.Embed(arch.vocab_size, arch.d_model, embedding_init=_INIT, dtype=dtype,
                               param_dtype=jnp.float32, rngs=rngs)
        if scan_layers:
            self.layers = stacked_layers(arch, rngs, **block_kw)
        else:
            self.blocks = nnx.List([LlamaBlock(arch, rngs=rngs, **block_kw) for _ in range(arch.n_layers)])
        self.norm = RMSNorm(arch.d_model, arch.rms_norm_eps, dtype)
        if not arch.tie_embeddings:
            self.head = nnx.Linear(arch.d_model, arch.vocab_size, use_bias=False, kernel_init=_INIT, dtype=dtype,
                                   param_dtype=jnp.float32, rngs=rngs)

    @property
    def vocab_size(self) -> int:
        return self.arch.vocab_size

    def __call__(self, tokens: jax.Array, *, train: bool = True, rngs: nnx.Rngs | jax.Array | None = None) -> jax.Array:
        """int32 (b, T) → (b, T, vocab_size) float32 logits; train=True applies dropout (when > 0) with
        masks from `rngs` (an nnx.Rngs with a "dropout" stream, or a key)."""
        return self.logits(self.hidden(tokens, train=train, rngs=rngs))

    def rotary(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """cos, sin (b or 1, T, head_dim) in the compute dtype for `positions` (b or 1, T) int32."""
        a = self.arch
        return rotary_angles(positions, inverse_frequencies(a.head_dim, a.rope_theta, a.rope_scaling), self.dtype)

    def hidden(self, tokens: jax.Array, *, train: bool = True, rngs: nnx.Rngs | jax.Array | None = None) -> jax.Array:
        """int32 (b, T) → the residual stream after the last block (b, T, d_model), before the final norm."""
        if tokens.ndim != 2:
            raise ValueError(f"tokens must have shape (batch, T), got {tokens.shape}.")
        t = tokens.shape[1]
        if t > self.context:
            raise ValueError(f"sequence length {t} exceeds the model's context of {self.context}.")
        rngs = _dropout_rngs(rngs, train, self.dropout)
        outer = (self.embed, self.norm) + (() if self.tie_embeddings else (self.head,))
        for part in (outer if self.scan_layers else (self,)):
            nnx.update(part, gather(nnx.state(part)))  # whole params outside the scanned layers
        x = pin_batch(self.embed(tokens))
        cos, sin = self.rotary(jnp.arange(t)[None])
        if self.scan_layers:
            return run_stacked(self.layers, x, cos, sin, train, rngs, self.n_layers, self.remat)
        forward = _remat_block_forward if self.remat else _block_forward
        for block in self.blocks:
            x = pin_batch(forward(block, x, cos, sin, train, rngs))
        return x

    def head_weight(self) -> tuple[jax.Array, int]:
        """The head's matrix and its classes axis: the embedding (vocab, d_model) when tied, else the
        head's kernel (d_model, vocab)."""
        return (self.embed.embedding[...], 0) if self.tie_embeddings else (self.head.kernel[...], 1)

    def logits(self, x: jax.Array) -> jax.Array:
        """The residual stream (b, T, d_model) → float32 logits (b, T, vocab_size): final norm, then head."""
        x = self.norm(x)
        return (self.embed.attend(x) if self.tie_embeddings else self.head(x)).astype(jnp.float32)

    def token_losses(self, tokens: jax.Array, labels: jax.Array, *, chunk: int, train: bool = True,
                     rngs: nnx.Rngs | jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """int32 tokens and labels (b, T) → (nll float32, argmax int32), each (b, T), through the fused,
        chunked cross-entropy (`chunk` positions per block): the whole logits are never built. Equal to
        rounding to the cross-entropy of `self(tokens)` and its argmax."""
        w, classes_axis = self.head_weight()
        x = self.norm(self.hidden(tokens, train=train, rngs=rngs))
        return fused_cross_entropy(x, w, labels, chunk=chunk, classes_axis=classes_axis, dtype=self.dtype)

__all__ = ["Llama", "LlamaAttention", "LlamaBlock", "RMSNorm", "grouped_attention", "run_stacked", "stacked_layers"]
