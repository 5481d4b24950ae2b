"""A fused, chunked softmax cross-entropy: the head matmul and the log-sum-exp per block of positions.

A language model's loss over a large vocabulary spends most of its memory traffic outside the
matmuls on the (tokens, vocab) float32 logits: at batch 32 × 1024 with GPT-2's 50,304 classes they
are 6.6 GB, written and read several times. `fused_cross_entropy` never builds them whole: a
`lax.scan` over chunks of positions computes each chunk's logits, its log-sum-exp (float32) and
its label's logit, keeps only the per-token log-sum-exp, and a `jax.custom_vjp` backward pass
recomputes each chunk's logits to accumulate the gradients of the hidden states and of the head.
The price is one more head matmul (the recomputation) for logits that live one chunk at a time.

Numerics are those of the plain loss, `optax.softmax_cross_entropy_with_integer_labels(x @ w, y)`
with the logits computed in the compute dtype and cast to float32 (as jdp's GPT does): the same
per-row matmul, a float32 log-sum-exp; the head's gradient is summed over chunks in float32 and
rounded to the compute dtype once.
"""
from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import optax


def _logits(x: jax.Array, w: jax.Array, classes_axis: int) -> jax.Array:
    """x (..., d) and w (d, V) [classes_axis=1] or (V, d) [0], both in the compute dtype → float32 (..., V).

    The matmul's result is in the compute dtype, then cast: what the plain head computes."""
    logits = jnp.dot(x, w) if classes_axis == 1 else jnp.dot(x, w.T)
    return logits.astype(jnp.float32)


def _chunks(a: jax.Array, chunk: int, n_chunks: int) -> jax.Array:
    """(rows, T, ...) → (n_chunks, rows, chunk, ...), zero-padded along T to n_chunks · chunk."""
    pad = n_chunks * chunk - a.shape[1]
    a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2)) if pad else a
    return jnp.moveaxis(a.reshape(a.shape[0], n_chunks, chunk, *a.shape[2:]), 1, 0)


def _unchunk(a: jax.Array, t: int) -> jax.Array:
    """(n_chunks, rows, chunk, ...) → (rows, t, ...): the inverse of `_chunks`, padding dropped."""
    a = jnp.moveaxis(a, 0, 1)
    return a.reshape(a.shape[0], a.shape[1] * a.shape[2], *a.shape[3:])[:, :t]


def _forward(x, w, labels, chunk: int, classes_axis: int):
    """(nll, predicted, lse), each (rows, T): per-token loss, argmax class and log-sum-exp (float32)."""
    t = x.shape[1]
    n_chunks = -(-t // chunk)

    def body(_, xs):
        xc, yc = xs
        logits = _logits(xc, w, classes_axis)  # (rows, chunk, V) float32: the only logits alive
        lse = jax.nn.logsumexp(logits, axis=-1)
        label_logit = jnp.take_along_axis(logits, yc[..., None], axis=-1)[..., 0]
        return None, (lse - label_logit, jnp.argmax(logits, axis=-1).astype(jnp.int32), lse)

    _, outs = jax.lax.scan(body, None, (_chunks(x, chunk, n_chunks), _chunks(labels, chunk, n_chunks)))
    return tuple(_unchunk(o, t) for o in outs)


def _varying_zeros(shape: tuple, *like: jax.Array) -> jax.Array:
    """float32 zeros varying over the manual mesh axes any of `like` varies over: inside shard_map a
    scan's carry must have its body's type, and the head's gradient varies per device."""
    axes = set().union(*(jax.typeof(a).manual_axis_type.varying for a in like))
    zeros = jnp.zeros(shape, jnp.float32)
    return jax.lax.pcast(zeros, tuple(sorted(axes)), to="varying") if axes else zeros


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _fused(x, w, labels, chunk: int, classes_axis: int):
    nll, predicted, _ = _forward(x, w, labels, chunk, classes_axis)
    return nll, predicted


def _fused_fwd(x, w, labels, chunk, classes_axis):
    nll, predicted, lse = _forward(x, w, labels, chunk, classes_axis)
    return (nll, predicted), (x, w, labels, lse)


def _fused_bwd(chunk, classes_axis, residuals, cotangents):
    """d(Σ g · nll)/dx and /dw, chunk by chunk: dlogits = (softmax − onehot(label)) · g per token.

    g is the cotangent of each token's loss (a weight, 0 for a masked token); the head's gradient
    is accumulated over chunks in float32."""
    x, w, labels, lse = residuals
    g = cotangents[0]
    t, n_chunks = x.shape[1], -(-x.shape[1] // chunk)

    def body(dw, xs):
        xc, yc, lc, gc = xs
        logits = _logits(xc, w, classes_axis)
        onehot = jax.nn.one_hot(yc, logits.shape[-1], dtype=jnp.float32)
        dlogits = ((jnp.exp(logits - lc[..., None]) - onehot) * gc[..., None]).astype(w.dtype)
        if classes_axis == 1:  # w (d, V)
            dx = jnp.dot(dlogits, w.T)
            dw_c = jnp.einsum("rcd,rcv->dv", xc, dlogits, preferred_element_type=jnp.float32)
        else:  # w (V, d)
            dx = jnp.dot(dlogits, w)
            dw_c = jnp.einsum("rcv,rcd->vd", dlogits, xc, preferred_element_type=jnp.float32)
        return dw + dw_c, dx.astype(x.dtype)

    xs = tuple(_chunks(a, chunk, n_chunks) for a in (x, labels, lse, g))  # g padded with 0: no gradient
    dw, dx = jax.lax.scan(body, _varying_zeros(w.shape, x, w, lse, g), xs)
    return _unchunk(dx, t), dw.astype(w.dtype), None


_fused.defvjp(_fused_fwd, _fused_bwd)


def fused_cross_entropy(x: jax.Array, w: jax.Array, labels: jax.Array, *, chunk: int, classes_axis: int = 1,
                        dtype=None) -> tuple[jax.Array, jax.Array]:
    """Per-token softmax cross-entropy of the logits `x @ w` and integer `labels`, chunked along T.

    x (..., T, d) hidden states; w the head, (d, V) with classes_axis=1 (a Linear's kernel) or
    (V, d) with classes_axis=0 (an embedding: the tied head, logits x @ w.T); labels (..., T)
    integers in [0, V). Returns `(nll, predicted)`, each (..., T): nll float32, the loss of each
    token, unreduced (no scale: sum or weight it yourself; a token given weight 0 gets no
    gradient); predicted int32, each token's argmax class (for accuracy; not differentiable).

    `chunk` positions along T per block: one block's logits, (rows, chunk, V) float32 with rows the
    product of the leading dims, are all that lives at once; a last partial block is padded.
    `dtype`: the compute dtype x and w are cast to (None: as given, which must be one dtype); the
    logits are computed in it and cast to float32 before the log-sum-exp. Differentiable in x and
    w (gradients in their own dtypes), equal to the plain loss to rounding.
    """
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk={chunk!r} must be a positive integer (positions per block).")
    if classes_axis not in (0, 1) or w.ndim != 2:
        raise ValueError(f"classes_axis={classes_axis!r} with w of shape {w.shape}: w must be (d, V) with "
                         f"classes_axis=1 or (V, d) with classes_axis=0.")
    d = w.shape[1 - classes_axis]
    if x.ndim < 2 or x.shape[-1] != d or labels.shape != x.shape[:-1]:
        raise ValueError(f"x of shape {x.shape} and labels of shape {labels.shape} do not fit w of shape {w.shape}: "
                         f"x must be (..., T, {d}) and labels (..., T).")
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise ValueError(f"labels have dtype {labels.dtype}; they must be integer class ids.")
    if dtype is not None:
        x, w = x.astype(dtype), w.astype(dtype)
    elif x.dtype != w.dtype:
        raise ValueError(f"x is {x.dtype} and w is {w.dtype}: pass dtype= to compute both in one dtype.")
    lead = x.shape[:-2]
    rows = math.prod(lead)
    nll, predicted = _fused(x.reshape(rows, *x.shape[-2:]), w, labels.reshape(rows, labels.shape[-1]).astype(jnp.int32),
                            min(chunk, x.shape[-2]), classes_axis)
    return nll.reshape(labels.shape), predicted.reshape(labels.shape)


def plain_cross_entropy(x: jax.Array, w: jax.Array, labels: jax.Array, *, classes_axis: int = 1,
                        dtype=None) -> tuple[jax.Array, jax.Array]:
    """The definition `fused_cross_entropy` equals: the whole (..., T, V) float32 logits, then optax's loss.

    Same arguments and results (nll float32 and argmax int32, each (..., T)), no `chunk`."""
    if dtype is not None:
        x, w = x.astype(dtype), w.astype(dtype)
    logits = _logits(x, w, classes_axis)
    return (optax.softmax_cross_entropy_with_integer_labels(logits, labels),
            jnp.argmax(logits, axis=-1).astype(jnp.int32))


__all__ = ["fused_cross_entropy", "plain_cross_entropy"]
