"""A small GPT-style causal transformer (Flax NNX).

Dropout randomness is an argument of every call, never state of the module: the Dropout layers
are built without `rngs`, and `GPT.__call__(tokens, train=True, rngs=nnx.Rngs(dropout=key))`
supplies the key. jdp splits and merges the module fresh inside each jitted step, so an RNG
counter stored in the module would make the masks depend on host-side state; with the key
passed in, a mask is a function of the key alone (jdp derives one per (seed, micro-step,
device) with `jdp.core.state.device_key`).

Options: `dtype` (compute dtype; params and logits stay float32), `attention="fused"` (causality
from `jax.nn.dot_product_attention(..., is_causal=True)` instead of a materialised mask, same
params) and `remat=True` (each block is recomputed in the backward pass instead of storing its
activations: less memory, one more forward pass of the blocks).

`scan_layers=True` stacks the blocks' params (a leading axis of n_layers; the same blocks, made
from the same Rngs, and the same dropout masks as without it) and runs them in one `jax.lax.scan`
whose body takes one layer's params; with remat the body is a `jax.checkpoint`. Every params use goes through `jdp.fsdp.gather`: the identity, except under
`shard_params=True, gather_in_model=True`, where the body gathers that one layer's params (and
the backward pass reduce-scatters its gradient), so the compiled step holds about one layer whole.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from jdp.core.global_view import pin_batch
from jdp.core.split import gather, gather_layer_axis
from jdp.models.dtypes import compute_dtype
from jdp.models.xent import fused_cross_entropy

_EMBED_INIT = nnx.initializers.normal(stddev=0.02)
ATTENTIONS = ("flax", "fused", "cudnn")


def _fused_attention(query: jax.Array, key: jax.Array, value: jax.Array, bias=None, mask=None, *,
                     dropout_rate: float = 0.0, dtype=None, module=None, implementation=None,
                     **unused) -> jax.Array:
    """Causal attention for `nnx.MultiHeadAttention(attention_fn=...)`: (batch, T, heads, head_dim) each → same.

    `jax.nn.dot_product_attention(..., is_causal=True)` applies causality itself, so no
    (batch, 1, T, T) mask is built or passed. With no `implementation=` given, jax 0.10 runs its
    XLA implementation on every backend (cuDNN flash attention only with implementation="cudnn").
    q/k/v are cast to the layer's compute `dtype`: that function needs one dtype for all three.
    The other keywords MultiHeadAttention passes (dropout_rng, deterministic, precision, ...)
    have no effect here: the GPT builds its attention with dropout_rate=0 and never sows weights.
    """
    del unused
    if bias is not None or mask is not None or dropout_rate != 0.0 or module is not None:
        raise ValueError("attention='fused' takes no bias, mask, attention dropout or sown weights.")
    if dtype is not None:
        query, key, value = (a.astype(dtype) for a in (query, key, value))
    return jax.nn.dot_product_attention(query, key, value, is_causal=True, implementation=implementation)


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

    (batch, T, d_model) → (batch, T, d_model) in the compute `dtype`; attention is causal
    (position t sees ≤ t). "fused"/"cudnn" swap only the attention function: the params are the same.
    """

    def __init__(self, d_model: int, n_heads: int, dropout: float, *, dtype: jnp.dtype, attention: str,
                 rngs: nnx.Rngs, bias: bool = True, gelu_approximate: bool = True, ln_epsilon: float = 1e-6):
        kw = dict(dtype=dtype, param_dtype=jnp.float32, use_bias=bias, rngs=rngs)
        ln = dict(kw, epsilon=ln_epsilon)
        self.gelu_approximate = gelu_approximate
        self.ln1 = nnx.LayerNorm(d_model, **ln)
        # Attention-weight dropout off (dropout_rate=0.0), so the layer keeps no RNG stream;
        # dropout is applied to its output below, with the key given at call time.
        implementation = "cudnn" if attention == "cudnn" else None  # None: jax's XLA attention
        extra = {} if attention == "flax" else {"attention_fn": partial(_fused_attention, implementation=implementation)}
        self.attn = nnx.MultiHeadAttention(n_heads, d_model, dropout_rate=0.0, decode=False,
                                           keep_rngs=False, **extra, **kw)
        self.drop1 = nnx.Dropout(dropout)
        self.ln2 = nnx.LayerNorm(d_model, **ln)
        self.fc = nnx.Linear(d_model, 4 * d_model, **kw)
        self.proj = nnx.Linear(4 * d_model, d_model, **kw)
        self.drop2 = nnx.Dropout(dropout)

    def __call__(self, x: jax.Array, mask: jax.Array | None, *, train: bool,
                 rngs: nnx.Rngs | jax.Array | None) -> jax.Array:
        """x (batch, T, d_model), mask (batch, 1, T, T) bool, or None for fused attention → (batch, T, d_model).

        `rngs`: the Rngs both dropouts draw from, in order, or their two keys drawn ahead (shape (2,),
        as the scanned GPT passes them), or None when dropout is off."""
        first, second = (rngs, rngs) if rngs is None or isinstance(rngs, nnx.Rngs) else (rngs[0], rngs[1])
        h = self.attn(self.ln1(x), mask=mask, deterministic=True)
        x = x + self.drop1(h, deterministic=not train, rngs=first)
        return x + self.drop2(self.mlp(x), deterministic=not train, rngs=second)

    def mlp(self, x: jax.Array) -> jax.Array:
        """The block's feed-forward branch, before its dropout: (batch, T, d_model) → (batch, T, d_model)."""
        return self.proj(nnx.gelu(self.fc(self.ln2(x)), approximate=self.gelu_approximate))


def _block_forward(block: Block, x: jax.Array, mask: jax.Array | None, train: bool,
                   rngs: nnx.Rngs | None) -> jax.Array:
    """`block(x, mask, ...)` as a function of its arguments only, for `nnx.remat`."""
    return block(x, mask, train=train, rngs=rngs)


# jax.checkpoint lifted to NNX: the block (params) and the Rngs are arguments, so the dropout
# keys drawn inside are the same ones a plain call draws and the Rngs' counter advances outside
# too. `train` is static (a Python bool choosing code paths).
_remat_block_forward = nnx.remat(_block_forward, static_argnums=(3,))


def stacked_blocks(n_layers: int, *args, rngs: nnx.Rngs, **kwargs) -> Block:
    """`n_layers` Blocks as one module whose params have a leading axis of n_layers. The Blocks are
    made one after another from `rngs`, as an unscanned GPT makes them, and then stacked: scanning
    the layers changes how they run, not their initial params."""
    blocks = [Block(*args, rngs=rngs, **kwargs) for _ in range(n_layers)]
    graphdef, _ = nnx.split(blocks[0])
    return nnx.merge(graphdef, jax.tree.map(lambda *layers: jnp.stack(layers), *(nnx.state(b) for b in blocks)))


def scan_blocks(layers: Block, x, mask, train: bool, rngs: nnx.Rngs | None, n_layers: int, remat: bool):
    """x (batch, T, d_model) through the stacked blocks, one `lax.scan` step per layer.

    The body gathers its layer's params (`jdp.fsdp.gather`: a no-op unless the model gathers its
    own split params) and, with `remat`, is a `jax.checkpoint`: the backward pass gathers again
    instead of keeping every layer's whole params. The dropout keys are drawn ahead from `rngs`,
    two per layer in the order the unscanned blocks draw them, so both forms drop the same units.
    """
    graphdef, stack = nnx.split(layers)
    stack = gather_layer_axis(stack)  # a leaf split along its layers (no later dimension divides): whole first
    keys = None if rngs is None else jnp.stack([jnp.stack([rngs.dropout(), rngs.dropout()]) for _ in range(n_layers)])

    def body(x, xs):
        layer, key = xs
        return pin_batch(nnx.merge(graphdef, gather(layer))(x, mask, train=train, rngs=key)), None

    return jax.lax.scan(jax.checkpoint(body) if remat else body, x, (stack, keys))[0]


class GPT(nnx.Module):
    """Token + learned position embeddings, `n_layers` causal blocks, final LayerNorm, linear head.

    Input int32 tokens (batch, T) with T ≤ context; output float32 logits (batch, T, vocab_size),
    where position t depends only on tokens[:, :t + 1].

    Params float32; compute in `dtype` (None: float32; jnp.bfloat16 / "bf16": bfloat16 matmuls,
    embeddings and residual stream); logits float32. `attention`: "flax" (MultiHeadAttention with
    a (batch, 1, T, T) causal mask), "fused" (the same module and params, attention through
    `jax.nn.dot_product_attention(is_causal=True)`, which in jax 0.10 runs XLA's implementation on
    every backend) or "cudnn" (the same call with implementation="cudnn": cuDNN flash attention,
    GPUs and bfloat16 only). `remat=True` rematerialises every block; `scan_layers=True` stacks
    them and runs them in one `lax.scan` (`scan_blocks`).

    Architecture options (the defaults are this model as it always was): `bias=False` drops the
    biases of every Linear, attention projection and LayerNorm; `tie_embeddings=True` computes the
    logits as `x @ tok_embed.embedding.T` (one (vocab, d_model) matrix, no `head`);
    `gelu_approximate=False` is the exact erf GELU instead of the tanh approximation;
    `ln_epsilon` is every LayerNorm's epsilon. nanoGPT's GPT is `tie_embeddings=True,
    gelu_approximate=False, ln_epsilon=1e-5` with its `bias` (`jdp.models.gpt_from_nanogpt`).

    The loss without the whole logits: `token_losses(tokens, labels, chunk=N)` runs the head and the
    cross-entropy N positions at a time (`jdp.models.fused_cross_entropy`); `hidden` is the
    residual stream that both it and `__call__` start from.
    """

    def __init__(self, vocab_size: int, context: int, d_model: int = 64, n_heads: int = 4, n_layers: int = 2,
                 dropout: float = 0.1, *, dtype=None, attention: str = "flax", remat: bool = False,
                 scan_layers: bool = False, bias: bool = True, tie_embeddings: bool = False,
                 gelu_approximate: bool = True, ln_epsilon: float = 1e-6, rngs: nnx.Rngs):
        if min(vocab_size, context, d_model, n_heads, n_layers) < 1:
            raise ValueError(f"vocab_size={vocab_size}, context={context}, d_model={d_model}, n_heads={n_heads} "
                             f"and n_layers={n_layers} must all be positive.")
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} must be divisible by n_heads={n_heads}.")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout={dropout} must be in [0, 1).")
        if not ln_epsilon > 0.0:
            raise ValueError(f"ln_epsilon={ln_epsilon} must be positive.")
        if attention not in ATTENTIONS:
            raise ValueError(f"attention={attention!r} is not one of {ATTENTIONS}.")
        dtype = compute_dtype(dtype)
        if attention == "cudnn" and (jax.default_backend() != "gpu" or dtype != jnp.bfloat16):
            raise ValueError(f"attention='cudnn' (cuDNN flash attention) needs a GPU and dtype bfloat16; here jax "
                             f"runs on {jax.default_backend()!r} with dtype {jnp.dtype(dtype).name}: use 'fused'.")
        self.context, self.dropout = int(context), float(dropout)
        self.attention, self.remat, self.scan_layers, self.n_layers = attention, bool(remat), bool(scan_layers), n_layers
        self.tie_embeddings = bool(tie_embeddings)
        kw = dict(dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        block_kw = dict(dtype=dtype, attention=attention, bias=bias, gelu_approximate=gelu_approximate,
                        ln_epsilon=ln_epsilon)
        self.tok_embed = nnx.Embed(vocab_size, d_model, embedding_init=_EMBED_INIT, **kw)
        self.pos_embed = nnx.Embed(context, d_model, embedding_init=_EMBED_INIT, **kw)
        self.drop = nnx.Dropout(dropout)
        if scan_layers:
            self.layers = stacked_blocks(n_layers, d_model, n_heads, dropout, rngs=rngs, **block_kw)
        else:
            self.blocks = nnx.List([Block(d_model, n_heads, dropout, rngs=rngs, **block_kw) for _ in range(n_layers)])
        self.ln_f = nnx.LayerNorm(d_model, epsilon=ln_epsilon, use_bias=bias, **kw)
        if not tie_embeddings:  # tied: the logits are x @ tok_embed.embedding.T, no head params
            self.head = nnx.Linear(d_model, vocab_size, use_bias=False, **kw)

    def __call__(self, tokens: jax.Array, *, train: bool = True,
                 rngs: nnx.Rngs | jax.Array | None = None) -> jax.Array:
        """int32 (batch, T) → (batch, T, vocab_size) float32 logits.

        train=True applies dropout (embeddings, attention output, MLP output) with masks drawn
        from `rngs` (an `nnx.Rngs` with a "dropout" stream, or a bare key); it is required when
        dropout > 0. train=False is deterministic and needs no key.
        """
        return self.logits(self.hidden(tokens, train=train, rngs=rngs))

    def token_losses(self, tokens: jax.Array, labels: jax.Array, *, chunk: int, train: bool = True,
                     rngs: nnx.Rngs | jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """int32 tokens and labels (batch, T) → (nll, predicted), each (batch, T): each token's
        cross-entropy (float32, unreduced) and the head's argmax (int32), through
        `jdp.models.xent.fused_cross_entropy` with `chunk` positions per block: the (batch, T,
        vocab_size) logits are never built whole. Equal, to rounding, to
        `optax.softmax_cross_entropy_with_integer_labels(self(tokens), labels)` and
        `self(tokens).argmax(-1)`; `train` and `rngs` as in `__call__`."""
        x = self.ln_f(self.hidden(tokens, train=train, rngs=rngs))
        w, classes_axis = ((self.tok_embed.embedding[...], 0) if self.tie_embeddings else (self.head.kernel[...], 1))
        return fused_cross_entropy(x, w, labels, chunk=chunk, classes_axis=classes_axis, dtype=self.tok_embed.dtype)

    def hidden(self, tokens: jax.Array, *, train: bool = True,
               rngs: nnx.Rngs | jax.Array | None = None) -> jax.Array:
        """int32 (batch, T) → the residual stream after the last block, (batch, T, d_model) in the
        compute dtype (before the final LayerNorm); `train` and `rngs` as in `__call__`."""
        if tokens.ndim != 2:
            raise ValueError(f"tokens must have shape (batch, T), got {tokens.shape}.")
        t = tokens.shape[1]
        if t > self.context:
            raise ValueError(f"sequence length {t} exceeds the model's context of {self.context}.")
        rngs = _dropout_rngs(rngs, train, self.dropout)
        outer = (self.tok_embed, self.pos_embed, self.ln_f) + (() if self.tie_embeddings else (self.head,))
        for part in (outer if self.scan_layers else (self,)):
            nnx.update(part, gather(nnx.state(part)))  # whole params outside the scanned layers
        x = self.tok_embed(tokens) + self.pos_embed(jnp.arange(t))
        # backend="jit": the residual stream pinned batch-sharded (here and after every block), or the
        # partitioner carries a split params leaf's layout into the activations (more all-gathers).
        x = pin_batch(self.drop(x, deterministic=not train, rngs=rngs))
        # "fused"/"cudnn" get causality from is_causal, so no (T, T) mask is materialised for them.
        mask = nnx.make_causal_mask(tokens) if self.attention == "flax" else None
        if self.scan_layers:
            x = scan_blocks(self.layers, x, mask, train, rngs, self.n_layers, self.remat)
        else:
            forward = _remat_block_forward if self.remat else _block_forward
            for block in self.blocks:
                x = pin_batch(forward(block, x, mask, train, rngs))
        return x

    @property
    def vocab_size(self) -> int:
        return self.tok_embed.num_embeddings

    def logits(self, x: jax.Array) -> jax.Array:
        """The residual stream (batch, T, d_model) → float32 logits (batch, T, vocab_size): the final
        LayerNorm, then the head (with tie_embeddings, the token embedding's transpose)."""
        x = self.ln_f(x)
        return (self.tok_embed.attend(x) if self.tie_embeddings else self.head(x)).astype(jnp.float32)
