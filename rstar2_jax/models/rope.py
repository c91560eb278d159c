"""Rotary position embeddings, Hugging Face "half-split" layout, computed in float32.

HF rotates the pair (x[i], x[i + d/2]) (not interleaved pairs). Frequencies follow
transformers' `ROPE_INIT_FUNCTIONS` for the supported types (default, linear, llama3), in
float32 like HF; the rotation itself is done in float32 and cast back to the input dtype, so a
bf16 model keeps full-precision angles at long positions.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from rstar2_jax.models.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """float32 [head_dim // 2] inverse frequencies, as transformers computes them."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (np.float32(1.0) / (np.float32(rope.theta) ** exponents)).astype(np.float32)
    if rope.rope_type == "linear":
        inv_freq = (inv_freq / np.float32(rope.factor)).astype(np.float32)
    elif rope.rope_type == "llama3":
        old_context = rope.original_max_position_embeddings
        low_freq_wavelen = old_context / rope.low_freq_factor
        high_freq_wavelen = old_context / rope.high_freq_factor
        wavelen = np.float32(2 * math.pi) / inv_freq
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / np.float32(rope.factor), inv_freq)
        smooth = (old_context / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / np.float32(rope.factor) + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        inv_freq = np.where(is_medium, smoothed, scaled).astype(np.float32)
    return inv_freq


def rope_angles(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """(sin, cos), each float32 [B, T, head_dim], for int positions [B, T]."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.sin(emb), jnp.cos(emb)


def apply_rope(x: jax.Array, sin: jax.Array, cos: jax.Array) -> jax.Array:
    """Rotate x [B, T, heads, head_dim] by angles [B, T, head_dim]; float32 inside."""
    dtype = x.dtype
    x = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    out = x * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return out.astype(dtype)
