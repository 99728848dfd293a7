"""DeepSeek-V4 checkpoint number formats (spec §5.3): encode / decode in numpy (and jnp where useful).

* **F8_E8M0** scale bytes: byte b -> 2^(b-127); b = 255 is NaN. No zero, no mantissa.
* **FP8 block weights**: e4m3 [N, K] with e8m0 scales [ceil(N/128), ceil(K/128)];
  W[n, k] = e4m3[n, k] * 2^(scale[n // 128, k // 128] - 127).
* **FP4 experts**: e2m1 packed two per int8 byte [N, K/2] (low nibble = even element, bit 3 sign, bits 0-2 index
  {0, .5, 1, 1.5, 2, 3, 4, 6}) with e8m0 scales [N, ceil(K/32)]; W[n, k] = LUT[nib] * 2^(scale[n, k // 32] - 127).

Quantizers pick power-of-two scales rounding up: s = 2^ceil(log2(amax / fmt_max)) (fmt_max 448 for e4m3, 6 for
e2m1), so |x / s| <= fmt_max and nothing clips. All-zero blocks get the scale of a tiny floor amax.
Decoding is exact in float32 (every e4m3 / e2m1 value times a power of two in [2^-127, 2^127] is a float32 unless
the product underflows below 2^-149, which real checkpoints never do).
"""

from __future__ import annotations


import ml_dtypes
import numpy as np

E4M3_MAX = 448.0
E2M1_MAX = 6.0
FP8_BLOCK = 128
FP4_BLOCK = 32
# e2m1 magnitudes by 3-bit code (bit 3 of the nibble is the sign).
FP4_LUT = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
FP4_LUT_SIGNED = np.concatenate([FP4_LUT, -FP4_LUT]).astype(np.float32)

__all__ = [
    "E4M3_MAX", "E2M1_MAX", "FP8_BLOCK", "FP4_BLOCK", "FP4_LUT",
    "e8m0_to_float", "float_to_e8m0", "pow2_scale_exponent",
    "e4m3_to_float", "float_to_e4m3",
    "dequant_fp8_block", "quant_fp8_block",
    "unpack_fp4", "pack_fp4", "dequant_fp4", "quant_fp4",
    "dequant_fp8_block_jnp", "dequant_fp4_jnp",
]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# ----------------------------------------------------------------------------------------------- e8m0 scales
def e8m0_to_float(b) -> np.ndarray:
    """uint8 (or ml_dtypes.float8_e8m0fnu) bytes -> float32 2^(b-127); 255 -> NaN."""
    b = np.asarray(b)
    if b.dtype != np.uint8:
        b = b.view(np.uint8) if b.dtype.itemsize == 1 else b.astype(np.uint8)
    with np.errstate(over="ignore"):
        out = np.ldexp(np.float32(1.0), b.astype(np.int32) - 127).astype(np.float32)
    return np.where(b == 255, np.float32(np.nan), out)


def float_to_e8m0(s) -> np.ndarray:
    """Exact powers of two (2^-127 .. 2^127) -> uint8 e8m0 bytes. Raises if a value is not a power of two."""
    s = np.asarray(s, np.float64)
    m, e = np.frexp(s)  # s = m * 2^e, m in [0.5, 1)
    if np.any(m != 0.5):
        raise ValueError("e8m0 can only represent positive powers of two")
    b = e.astype(np.int64) - 1 + 127
    if np.any((b < 0) | (b > 254)):
        raise ValueError("scale out of e8m0 range [2^-127, 2^127]")
    return b.astype(np.uint8)


def pow2_scale_exponent(amax, fmt_max: float, floor: float) -> np.ndarray:
    """Integer e = ceil(log2(max(amax, floor) / fmt_max)), computed exactly (no float log)."""
    x = np.maximum(np.asarray(amax, np.float64), floor) / fmt_max
    m, e = np.frexp(x)  # x = m * 2^e with m in [0.5, 1): log2 x in (e-1, e], == e-1 iff m == 0.5
    return np.where(m == 0.5, e - 1, e).astype(np.int64)


# ----------------------------------------------------------------------------------------------- e4m3
def e4m3_to_float(q) -> np.ndarray:
    """uint8 bit patterns (or float8_e4m3fn) -> float32."""
    q = np.asarray(q)
    if q.dtype != ml_dtypes.float8_e4m3fn:
        q = q.view(ml_dtypes.float8_e4m3fn)
    return q.astype(np.float32)


def float_to_e4m3(x) -> np.ndarray:
    """float -> uint8 e4m3fn bit patterns (round to nearest even, saturating at +-448)."""
    x = np.clip(np.asarray(x, np.float32), -E4M3_MAX, E4M3_MAX)
    return x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def _expand_blocks(s: np.ndarray, shape, block_rows: int, block_cols: int) -> np.ndarray:
    n, k = shape
    return np.repeat(np.repeat(s, block_rows, axis=0), block_cols, axis=1)[:n, :k]


def dequant_fp8_block(w, scale, block: int = FP8_BLOCK) -> np.ndarray:
    """e4m3 weight [N, K] (uint8 bits or float8_e4m3fn) + e8m0 scale [ceil(N/b), ceil(K/b)] -> float32 [N, K]."""
    w = e4m3_to_float(w)
    n, k = w.shape
    s = e8m0_to_float(scale)
    if s.shape != (_ceil_div(n, block), _ceil_div(k, block)):
        raise ValueError(f"fp8 scale shape {s.shape} does not match weight {w.shape} with {block}x{block} blocks")
    return w * _expand_blocks(s, (n, k), block, block)


def quant_fp8_block(x, block: int = FP8_BLOCK, floor: float = 1e-4):
    """float [N, K] -> (e4m3 uint8 [N, K], e8m0 uint8 scale [ceil(N/b), ceil(K/b)]).

    Per block s = 2^ceil(log2(max(amax, floor)/448)); q = e4m3(x / s).
    """
    x = np.asarray(x, np.float32)
    n, k = x.shape
    nb, kb = _ceil_div(n, block), _ceil_div(k, block)
    pad = np.zeros((nb * block, kb * block), np.float32)
    pad[:n, :k] = np.abs(x)
    amax = pad.reshape(nb, block, kb, block).max(axis=(1, 3))
    e = pow2_scale_exponent(amax, E4M3_MAX, floor)
    scale = (e + 127).astype(np.uint8)
    s_full = _expand_blocks(np.ldexp(np.float32(1.0), e.astype(np.int32)).astype(np.float32), (n, k), block, block)
    return float_to_e4m3(x / s_full), scale


# ----------------------------------------------------------------------------------------------- fp4 e2m1
def unpack_fp4(packed) -> np.ndarray:
    """int8/uint8 [..., K/2] -> float32 e2m1 values [..., K] (low nibble = even element)."""
    p = np.asarray(packed).view(np.uint8)
    lo, hi = p & 0x0F, p >> 4
    codes = np.stack([lo, hi], axis=-1).reshape(*p.shape[:-1], p.shape[-1] * 2)
    return FP4_LUT_SIGNED[codes]


def _float_to_e2m1_codes(x: np.ndarray) -> np.ndarray:
    """float32 (|x| <= 6) -> 4-bit codes (sign bit 3), round to nearest, ties to even code."""
    x = np.clip(np.asarray(x, np.float32), -E2M1_MAX, E2M1_MAX)
    return x.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0x0F


def pack_fp4(values) -> np.ndarray:
    """float values exactly representable in e2m1 [..., K] (K even) -> int8 [..., K/2]."""
    v = np.asarray(values, np.float32)
    if v.shape[-1] % 2:
        raise ValueError("fp4 packing needs an even number of inputs")
    codes = _float_to_e2m1_codes(v)
    if not np.array_equal(FP4_LUT_SIGNED[codes], v):
        raise ValueError("values are not exactly representable in e2m1; use quant_fp4")
    codes = codes.reshape(*v.shape[:-1], v.shape[-1] // 2, 2)
    return (codes[..., 0] | (codes[..., 1] << 4)).astype(np.uint8).view(np.int8)


def dequant_fp4(packed, scale, block: int = FP4_BLOCK) -> np.ndarray:
    """Packed e2m1 int8 [N, K/2] + e8m0 scale [N, ceil(K/32)] -> float32 [N, K]."""
    v = unpack_fp4(packed)
    n, k = v.shape
    s = e8m0_to_float(scale)
    if s.shape != (n, _ceil_div(k, block)):
        raise ValueError(f"fp4 scale shape {s.shape} does not match weight [{n}, {k}] with 1x{block} blocks")
    return v * _expand_blocks(s, (n, k), 1, block)


def quant_fp4(x, block: int = FP4_BLOCK, floor: float = 6.0 * 2.0 ** -126):
    """float [N, K] (K even) -> (packed int8 [N, K/2], e8m0 uint8 scale [N, ceil(K/32)]).

    Per 32-input block s = 2^ceil(log2(max(amax, floor)/6)); q = e2m1(x / s) rounded to nearest (ties to even).
    """
    x = np.asarray(x, np.float32)
    n, k = x.shape
    if k % 2:
        raise ValueError("fp4 packing needs an even number of inputs")
    kb = _ceil_div(k, block)
    pad = np.zeros((n, kb * block), np.float32)
    pad[:, :k] = np.abs(x)
    amax = pad.reshape(n, kb, block).max(axis=2)
    e = pow2_scale_exponent(amax, E2M1_MAX, floor)
    scale = (e + 127).astype(np.uint8)
    s_full = _expand_blocks(np.ldexp(np.float32(1.0), e.astype(np.int32)).astype(np.float32), (n, k), 1, block)
    codes = _float_to_e2m1_codes(x / s_full).reshape(n, k // 2, 2)
    packed = (codes[..., 0] | (codes[..., 1] << 4)).astype(np.uint8).view(np.int8)
    return packed, scale


# ----------------------------------------------------------------------------------------------- jnp versions
def dequant_fp8_block_jnp(w_u8, scale_u8, block: int = FP8_BLOCK, dtype=None):
    """jnp version of :func:`dequant_fp8_block` (uint8 inputs), for on-device dequantization."""
    import jax.numpy as jnp

    dtype = dtype or jnp.float32
    w = jnp.asarray(w_u8, jnp.uint8).view(jnp.float8_e4m3fn).astype(jnp.float32)
    s = jnp.ldexp(jnp.float32(1.0), jnp.asarray(scale_u8, jnp.uint8).astype(jnp.int32) - 127)
    s = jnp.where(jnp.asarray(scale_u8) == 255, jnp.nan, s)
    n, k = w.shape
    s = jnp.repeat(jnp.repeat(s, block, axis=0), block, axis=1)[:n, :k]
    return (w * s).astype(dtype)


def dequant_fp4_jnp(packed_i8, scale_u8, block: int = FP4_BLOCK, dtype=None):
    """jnp version of :func:`dequant_fp4`."""
    import jax.numpy as jnp

    dtype = dtype or jnp.float32
    p = jnp.asarray(packed_i8).view(jnp.uint8)
    codes = jnp.stack([p & 0x0F, p >> 4], axis=-1).reshape(p.shape[0], p.shape[1] * 2)
    v = jnp.asarray(FP4_LUT_SIGNED)[codes]
    s = jnp.ldexp(jnp.float32(1.0), jnp.asarray(scale_u8, jnp.uint8).astype(jnp.int32) - 127)
    s = jnp.where(jnp.asarray(scale_u8) == 255, jnp.nan, s)
    s = jnp.repeat(s, block, axis=1)[:, : v.shape[1]]
    return (v * s).astype(dtype)
