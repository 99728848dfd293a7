"""Interleaved (GPT-J) partial RoPE on the trailing channels — shared by the model and the kernel references."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


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
