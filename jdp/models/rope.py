"""Rotary position embeddings as Hugging Face transformers applies them to the Llama family.

A head's vector of `head_dim` (even) numbers is rotated in `head_dim / 2` planes, plane i pairing
element i with element i + head_dim / 2 (transformers' `rotate_half` layout, not the interleaved one of
Meta's original code: checkpoints in transformers' format are permuted for it). Plane i turns by
`position × inv_freq[i]`, with `inv_freq[i] = 1 / theta ** (2i / head_dim)` (`rope_theta`), optionally
rescaled:

- "linear": every frequency divided by `factor`;
- "llama3" (Llama 3.1+): frequencies whose wavelength exceeds `original_context / low_freq_factor`
  divided by `factor`, those under `original_context / high_freq_factor` kept, the ones between
  interpolated smoothly.

The frequencies are computed in float32 as transformers computes them (`_compute_default_rope_parameters`,
`_compute_llama3_parameters`), so the rotation agrees with its to float32 rounding.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

SCALINGS = ("linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """How the rotary frequencies are rescaled (config.json's `rope_scaling` / `rope_parameters`)."""

    kind: str  # "linear" or "llama3" (rope_type)
    factor: float
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_context: int = 8192  # llama3: original_max_position_embeddings

    def __post_init__(self):
        if self.kind not in SCALINGS:
            raise ValueError(f"rope scaling {self.kind!r} is not one jdp computes; it computes {', '.join(SCALINGS)}.")
        if not self.factor > 0:
            raise ValueError(f"rope scaling factor={self.factor} must be positive.")
        if self.kind == "llama3" and not (0 < self.low_freq_factor < self.high_freq_factor and self.original_context > 0):
            raise ValueError(f"llama3 rope scaling needs 0 < low_freq_factor ({self.low_freq_factor}) < high_freq_factor "
                             f"({self.high_freq_factor}) and a positive original_max_position_embeddings "
                             f"({self.original_context}).")


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> np.ndarray:
    """(head_dim // 2,) float32: each rotation plane's angle per position, in radians."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (np.float32(1.0) / (np.float32(theta) ** exponents)).astype(np.float32)
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return (inv_freq / np.float32(scaling.factor)).astype(np.float32)
    old, low, high = scaling.original_context, scaling.low_freq_factor, scaling.high_freq_factor
    wavelen = (np.float32(2 * math.pi) / inv_freq).astype(np.float32)
    scaled = np.where(wavelen > old / low, inv_freq / np.float32(scaling.factor), inv_freq).astype(np.float32)
    smooth = ((np.float32(old) / wavelen - np.float32(low)) / np.float32(high - low)).astype(np.float32)
    smoothed = ((1 - smooth) * scaled / np.float32(scaling.factor) + smooth * scaled).astype(np.float32)
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rotary_angles(positions: jax.Array, inv_freq: np.ndarray, dtype) -> tuple[jax.Array, jax.Array]:
    """cos and sin of `positions` (..., T) int × `inv_freq`: each (..., T, head_dim) in `dtype`, the plane's
    angle repeated for both halves of the head (transformers' `cat((freqs, freqs))`), computed in float32."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    angles = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x (b, T, heads, head_dim) rotated by cos/sin (b or 1, T, head_dim): x·cos + rotate_half(x)·sin."""
    half = x.shape[-1] // 2
    turned = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :] + turned * sin[:, :, None, :]


__all__ = ["SCALINGS", "RopeScaling", "inverse_frequencies", "rotary_angles", "rotate"]
