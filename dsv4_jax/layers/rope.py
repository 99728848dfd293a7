"""Interleaved (GPT-J) partial RoPE on the trailing `rope_dim` channels, main and YaRN compress tables (spec §3.5).

Sliding-only layers use the main table (theta = rope_theta, no scaling); every compressed layer (CSA/HCA) uses the
compress table (theta = compress_rope_theta, YaRN without mscale) for everything in that layer: q, window kv,
compressed entries, indexer q/k and the inverse rotation of the output.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from ..config import DeepseekV4Config


def rope_inv_freq(config: DeepseekV4Config, compressed: bool) -> tuple[float, ...]:
    """Inverse frequencies (rope_dim // 2 float32 values, as a hashable tuple so modules keep them static) of the
    main (compressed=False) or compress table."""
    return tuple(float(v) for v in _inv_freq(config, compressed))


def _inv_freq(config: DeepseekV4Config, compressed: bool) -> np.ndarray:
    dim = config.qk_rope_head_dim
    base = config.compress_rope_theta if compressed else config.rope_theta
    pos_freqs = np.float32(base) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    inv_freq = (np.float32(1.0) / pos_freqs).astype(np.float32)
    yarn = config.rope_scaling
    if not compressed or yarn is None:
        return inv_freq

    def correction_dim(n_rot):
        return dim * math.log(yarn.original_max_position_embeddings / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / np.float32(high - low), 0, 1).astype(np.float32)
    extrapolation = np.float32(1.0) - ramp  # 1 keeps the original frequency, 0 divides it by `factor`
    interpolated = (np.float32(1.0) / (np.float32(yarn.factor) * pos_freqs)).astype(np.float32)
    return (interpolated * (1 - extrapolation) + inv_freq * extrapolation).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq, inverse: bool = False) -> jax.Array:
    """Rotates the last `2 * len(inv_freq)` channels of x, pairs (2i, 2i+1), at `positions`.

    x: [B, S, ..., d]; positions: [B, S] int32 (broadcast over the middle axes). Computed in float32, returned in
    x.dtype. `inverse=True` applies the conjugate rotation (the output de-rotation of spec §3.11).
    """
    inv_freq = np.asarray(inv_freq, np.float32)
    rd = 2 * inv_freq.shape[0]
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, S, rd/2]
    angles = angles.reshape(angles.shape[:2] + (1,) * (x.ndim - 3) + angles.shape[-1:])
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if inverse:
        sin = -sin
    rope = x[..., -rd:].astype(jnp.float32).reshape(x.shape[:-1] + (rd // 2, 2))
    even, odd = rope[..., 0], rope[..., 1]
    rotated = jnp.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1).reshape(x.shape[:-1] + (rd,))
    return jnp.concatenate([x[..., :-rd], rotated.astype(x.dtype)], axis=-1)
