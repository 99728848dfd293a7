"""Indexer key formats (spec §4.3, §8.1) and the optional Walsh-Hadamard rotation.

* ``bf16``: keys stored as bfloat16 [.., dI] (or the model dtype in exact mode, fmt=None).
* ``fp8``:  dI e4m3 values + one float32 power-of-two scale per key: 128 + 4 = 132 B for dI = 128.
            s = 2^ceil(log2(max(amax, 1e-4) / 448)).
* ``fp4``:  dI/2 bytes of packed e2m1 (low nibble = even element) + dI/32 ue8m0 scales: 64 + 4 = 68 B for dI = 128.
            Per 32-block s = 2^ceil(log2(max(amax, 6 * 2^-126) / 6)), exponent clamped to [-127, 127].
Queries are quantized with the same rule per (token, head) (fake-quantized: they are never stored).
The rotation x -> H x / sqrt(dI) (Sylvester-Hadamard, dI a power of two) is applied to q and k before
quantization; without quantization it changes no score ((Hq).(Hk) = q.k).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp

FORMATS = (None, "bf16", "fp8", "fp4")
BYTES_PER_KEY = {"bf16": lambda d: 2 * d, "fp8": lambda d: d + 4, "fp4": lambda d: d // 2 + d // 32}
E4M3_MAX, E2M1_MAX = 448.0, 6.0
# the floors on the amax in the scale rules (module doc): fp8 per key / q head, fp4 per 32-block
E4M3_AMAX_FLOOR, E2M1_AMAX_FLOOR = 1e-4, E2M1_MAX * 2.0 ** -126
# fp4 keys on fp8 (e5m2) tensor cores: q / 2^(e_max - 13) puts a head's largest code at <= 6 * 2^13 < 57344 (e5m2's
# largest finite value), `gpu.quantize_q_fp8` and `q_prep.q_prep_fp4(e5m2=True)`
FP4_Q_SHIFT = 13
FP4_BLOCK = 32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedKeys:
    """Quantized indexer keys with any leading shape [...]: fp8 -> values e4m3 [..., dI], scale f32 [..., 1];
    fp4 -> values uint8 [..., dI/2] (packed e2m1), scale uint8 [..., dI/32] (ue8m0)."""

    values: jax.Array
    scale: jax.Array
    fmt: str = dataclasses.field(metadata=dict(static=True), default="fp8")

    @property
    def shape(self):
        d = self.values.shape[-1] * (2 if self.fmt == "fp4" else 1)
        return self.values.shape[:-1] + (d,)


def check_format(fmt: Optional[str]) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"indexer key format must be one of {FORMATS}, got {fmt!r}")


# The functions below are jitted (one program per shape): run op by op, each of their jnp calls would compile on
# its own (XLA:CPU: 20-100 ms apiece, seconds for a Hadamard rotation called eagerly in a notebook or a test).
@functools.partial(jax.jit, inline=True)
def hadamard(x: jax.Array) -> jax.Array:
    """Orthonormal Walsh-Hadamard transform over the last axis (length a power of two), float32."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"Hadamard rotation needs a power-of-two width, got {n}")
    y = x.astype(jnp.float32)
    h = 1
    while h < n:
        y = y.reshape(y.shape[:-1] + (n // (2 * h), 2, h))
        a, b = y[..., 0, :], y[..., 1, :]
        y = jnp.stack([a + b, a - b], axis=-2).reshape(x.shape)
        h *= 2
    return y * (n ** -0.5)


def _pow2_exponent(amax, fmt_max, floor):
    """ceil(log2(max(amax, floor) / fmt_max)) exactly: frexp gives amax' = m * 2^e with m in [0.5, 1)."""
    ratio = jnp.maximum(amax, floor) / fmt_max
    m, e = jnp.frexp(ratio)
    return jnp.where(m == 0.5, e - 1, e).astype(jnp.int32)


def _exp2(e):
    return jax.lax.bitcast_convert_type((jnp.clip(e, -126, 127) + 127).astype(jnp.int32) << 23, jnp.float32) \
        * jnp.where(e < -126, 0.5, 1.0)


def quantize(x: jax.Array, fmt: Optional[str], dtype=jnp.float32):
    """Rows x [..., dI] -> storage in `fmt` (an array for None/bf16, QuantizedKeys otherwise)."""
    check_format(fmt)
    return _quantize(x, fmt, dtype)


@functools.partial(jax.jit, static_argnums=(1, 2), inline=True)
def _quantize(x, fmt, dtype):
    if fmt is None:
        return x.astype(dtype)
    if fmt == "bf16":
        return x.astype(jnp.bfloat16)
    x = x.astype(jnp.float32)
    if fmt == "fp8":
        e = _pow2_exponent(jnp.max(jnp.abs(x), axis=-1, keepdims=True), E4M3_MAX, E4M3_AMAX_FLOOR)
        s = _exp2(e)
        return QuantizedKeys((x / s).astype(jnp.float8_e4m3fn), s, "fp8")
    blocks = x.reshape(x.shape[:-1] + (x.shape[-1] // FP4_BLOCK, FP4_BLOCK))
    e = jnp.clip(_pow2_exponent(jnp.max(jnp.abs(blocks), axis=-1), E2M1_MAX, E2M1_AMAX_FLOOR), -127, 127)
    codes = jax.lax.bitcast_convert_type((blocks / _exp2(e)[..., None]).astype(jnp.float4_e2m1fn), jnp.uint4)
    codes = codes.astype(jnp.uint8).reshape(x.shape[:-1] + (x.shape[-1] // 2, 2))
    packed = codes[..., 0] | (codes[..., 1] << 4)
    return QuantizedKeys(packed, (e + 127).astype(jnp.uint8), "fp4")


@functools.partial(jax.jit, static_argnums=1, inline=True)
def dequantize(k, dtype=jnp.float32) -> jax.Array:
    """Storage (array or QuantizedKeys) -> float rows [..., dI] in `dtype`."""
    if not isinstance(k, QuantizedKeys):
        return k.astype(dtype)
    if k.fmt == "fp8":
        return (k.values.astype(jnp.float32) * k.scale).astype(dtype)
    lo, hi = k.values & 0xF, k.values >> 4
    codes = jnp.stack([lo, hi], axis=-1).reshape(k.values.shape[:-1] + (2 * k.values.shape[-1],))
    vals = jax.lax.bitcast_convert_type(codes.astype(jnp.uint4), jnp.float4_e2m1fn).astype(jnp.float32)
    s = _exp2(k.scale.astype(jnp.int32) - 127)
    vals = vals.reshape(vals.shape[:-1] + (-1, FP4_BLOCK)) * s[..., None]
    return vals.reshape(codes.shape).astype(dtype)


@functools.partial(jax.jit, static_argnums=1, inline=True)
def fake_quantize(x: jax.Array, fmt: Optional[str]) -> jax.Array:
    """dequantize(quantize(x)) in float32 (used for queries, which are never stored).

    The storage passes an optimization barrier: XLA's GPU compiler removes an f32 -> narrower float -> f32 round
    trip (SimplifyFPConversions, under --xla_allow_excess_precision, on by default), and without the barrier q was
    not quantized at all on the H200 (session 21), in some programs and not others: the reference and pallas model
    paths then disagreed wherever the indexer's k-th pick was close, and the Mosaic kernel, which re-quantizes q,
    disagreed with both. (`pallas_kernels/numerics.py` rounds to bf16 by bit arithmetic for the same reason.)"""
    if fmt is None:
        return x.astype(jnp.float32)
    return dequantize(jax.lax.optimization_barrier(quantize(x, fmt)), jnp.float32)


def empty(shape, fmt: Optional[str], dtype=jnp.float32):
    """Zero storage for keys of logical shape [..., dI]."""
    return quantize(jnp.zeros(shape, jnp.float32), fmt, dtype)
