"""Rounding helpers that survive XLA's algebraic simplifier.

Under jit, XLA GPU (excess precision allowed, its default) folds a float32(bfloat16(x)) round trip back to x, so
code that rounds through bf16 by two casts silently keeps full precision there (and only there). These helpers
round by bit arithmetic instead.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def round_to_bf16(x: jax.Array) -> jax.Array:
    """float -> float32 holding the nearest bfloat16 (ties to even), like float32(bfloat16(x)) for finite x."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    bits = (bits + jnp.uint32(0x7FFF) + ((bits >> 16) & jnp.uint32(1))) & jnp.uint32(0xFFFF0000)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def round_to(x: jax.Array, dtype) -> jax.Array:
    """float32 values rounded to `dtype` and held in float32: `round_to_bf16` for bfloat16 (XLA GPU cannot fold it
    away), x itself for float32, otherwise two casts with an optimization barrier between them (without it XLA GPU
    folds them under jit, as it did to the indexer q's fake quantization in session 21)."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.bfloat16:
        return round_to_bf16(x)
    if dtype == jnp.float32:
        return x.astype(jnp.float32)
    return jax.lax.optimization_barrier(x.astype(dtype)).astype(jnp.float32)
