"""FP8 KV row layout of spec §4.2 (FlashMLA "MODEL1" / vLLM `fp8_ds_mla`) for the sparse-attention pools.

A 512-wide KV row (448 "nope" dims + 64 RoPE dims) is stored as
  * 448 e4m3 values (one power-of-two ue8m0 scale per 64-wide block, 7 blocks),
  * 64 bf16 RoPE values (not quantized),
  * 8 scale bytes: 7 ue8m0 exponents (byte = exponent + 127, value 2^(byte-127)) + 1 pad byte (127).
That is 448 + 128 + 8 = 584 bytes per row, the production byte count.

`Fp8KVPool` keeps the three parts as three typed arrays with one row per pool row (`nope` [N, 448] e4m3,
`rope` [N, 64] bf16, `scale` [N, 8] uint8) so kernels can gather each part with typed loads and no in-kernel
bit reinterpretation; `to_packed_u8` / `from_packed_u8` convert to / from the 584-byte rows
(576 data bytes = 448 e4m3 | 128 bf16 bytes, then the 8 scale bytes) for interchange with paged byte caches.

Quantisation rule (OF-K / vLLM): the fp32 row is rounded through bf16, per 64-block amax is clamped at 1e-4,
s = 2^ceil(log2(amax / 448)), e4m3 = round(x / s) (saturating at ±448 is never needed since |x/s| <= 448).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from ..numerics import round_to_bf16

NOPE_DIM = 448
ROPE_DIM = 64
HEAD_DIM = NOPE_DIM + ROPE_DIM
BLOCK = 64
N_BLOCKS = NOPE_DIM // BLOCK  # 7
SCALE_BYTES = 8
ROW_BYTES = NOPE_DIM + 2 * ROPE_DIM + SCALE_BYTES  # 584
E4M3_MAX = 448.0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8KVPool:
    """A flat FP8 KV pool: row r is `dequantize_kv_fp8(pool)[r]`, a [512] vector."""

    nope: jax.Array  # [N, 448] float8_e4m3fn
    rope: jax.Array  # [N, 64] bfloat16
    scale: jax.Array  # [N, 8] uint8 (ue8m0; byte 7 is padding)

    @property
    def shape(self):
        return (self.nope.shape[0], HEAD_DIM)

    @property
    def dtype(self):  # the logical (dequantized) dtype
        return jnp.bfloat16

    @property
    def nbytes_per_row(self) -> int:
        return ROW_BYTES

    def validate(self, name: str = "pool"):
        n = self.nope.shape[0]
        checks = [
            (self.nope.ndim == 2 and self.nope.shape[1] == NOPE_DIM, f"{name}.nope must be [N, {NOPE_DIM}]"),
            (self.nope.dtype == jnp.float8_e4m3fn, f"{name}.nope must be float8_e4m3fn, got {self.nope.dtype}"),
            (self.rope.shape == (n, ROPE_DIM), f"{name}.rope must be [N, {ROPE_DIM}], got {self.rope.shape}"),
            (self.rope.dtype == jnp.bfloat16, f"{name}.rope must be bfloat16, got {self.rope.dtype}"),
            (self.scale.shape == (n, SCALE_BYTES), f"{name}.scale must be [N, {SCALE_BYTES}], got {self.scale.shape}"),
            (self.scale.dtype == jnp.uint8, f"{name}.scale must be uint8, got {self.scale.dtype}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)


def is_fp8_pool(x) -> bool:
    return isinstance(x, Fp8KVPool)


def ue8m0_to_f32(b: jax.Array) -> jax.Array:
    """uint8 exponent bytes -> float32 2^(b-127) (exact, via the f32 exponent field)."""
    bits = b.astype(jnp.int32) << 23
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def block_exponent(amax: jax.Array) -> jax.Array:
    """The format's per-64-block scale exponent: ceil(log2(max(amax, 1e-4) / 448)) clipped to [-127, 127], int32
    (shared by `quantize_kv_fp8` and the compressor kernels that write these rows). Exact, from the f32 bit pattern
    of the ratio (normal: >= 1e-4 / 448): a float log2 is not, and XLA's CPU log2 put amax = 448 x 2^k (common for
    bf16 amax: mantissa 1.75) one binade high."""
    ratio = (jnp.maximum(amax, 1e-4) / E4M3_MAX).astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(ratio, jnp.int32)
    e = ((bits >> 23) & 0xFF) - 127
    e = jnp.where((bits & 0x7FFFFF) != 0, e + 1, e)
    return jnp.clip(e, -127, 127).astype(jnp.int32)


def quantize_kv_fp8(pool: jax.Array) -> Fp8KVPool:
    """[N, 512] float pool -> Fp8KVPool (per-64-block power-of-two scales on the first 448 dims)."""
    if pool.ndim != 2 or pool.shape[1] != HEAD_DIM:
        raise ValueError(f"quantize_kv_fp8 expects [N, {HEAD_DIM}], got {pool.shape}")
    return _quantize_kv_fp8(pool)


# one program per shape, not a compile per jnp call when called eagerly; inlined into a caller's jit
@functools.partial(jax.jit, inline=True)
def _quantize_kv_fp8(pool):
    x = round_to_bf16(pool)
    n = x.shape[0]
    nope = x[:, :NOPE_DIM].reshape(n, N_BLOCKS, BLOCK)
    exp = block_exponent(jnp.max(jnp.abs(nope), axis=-1))  # [N, 7]
    s = ue8m0_to_f32((exp + 127).astype(jnp.uint8))
    q = (nope / s[..., None]).astype(jnp.float8_e4m3fn).reshape(n, NOPE_DIM)
    scale = jnp.concatenate([(exp + 127).astype(jnp.uint8), jnp.full((n, 1), 127, jnp.uint8)], axis=1)
    return Fp8KVPool(nope=q, rope=x[:, NOPE_DIM:].astype(jnp.bfloat16), scale=scale)


def quantize_kv_fp8_rows(rows: jax.Array) -> Fp8KVPool:
    """[..., 512] rows -> Fp8KVPool whose fields keep the leading dims ([..., 448] / [..., 64] / [..., 8])."""
    lead = rows.shape[:-1]
    flat = quantize_kv_fp8(rows.reshape(-1, rows.shape[-1]))
    return jax.tree_util.tree_map(lambda a: a.reshape(lead + a.shape[1:]), flat)


def dequantize_rows(nope: jax.Array, rope: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
    """Parts of rows (any leading shape) -> [..., 512] in `dtype`."""
    lead = nope.shape[:-1]
    s = ue8m0_to_f32(scale[..., :N_BLOCKS])  # [..., 7]
    v = nope.astype(jnp.float32).reshape(*lead, N_BLOCKS, BLOCK) * s[..., None]
    return jnp.concatenate([v.reshape(*lead, NOPE_DIM), rope.astype(jnp.float32)], axis=-1).astype(dtype)


@functools.partial(jax.jit, static_argnums=1, inline=True)
def dequantize_kv_fp8(pool: Fp8KVPool, dtype=jnp.float32) -> jax.Array:
    """Fp8KVPool -> [N, 512] array."""
    return dequantize_rows(pool.nope, pool.rope, pool.scale, dtype)


def take_rows(pool, idx: jax.Array, dtype=jnp.float32) -> jax.Array:
    """Gather rows `idx` (already clamped in range) of a plain or FP8 pool -> [..., 512] in `dtype`."""
    if isinstance(pool, Fp8KVPool):
        return dequantize_rows(
            jnp.take(pool.nope, idx, axis=0), jnp.take(pool.rope, idx, axis=0), jnp.take(pool.scale, idx, axis=0), dtype
        )
    return jnp.take(pool, idx, axis=0).astype(dtype)


def to_packed_u8(pool: Fp8KVPool) -> jax.Array:
    """Fp8KVPool -> [N, 584] uint8 rows: 448 e4m3 bytes | 128 bytes of bf16 rope (little endian) | 8 scale bytes."""
    n = pool.nope.shape[0]
    nope_b = jax.lax.bitcast_convert_type(pool.nope, jnp.uint8)
    rope_b = jax.lax.bitcast_convert_type(pool.rope, jnp.uint8).reshape(n, 2 * ROPE_DIM)
    return jnp.concatenate([nope_b, rope_b, pool.scale], axis=1)


def from_packed_u8(rows: jax.Array) -> Fp8KVPool:
    """[N, 584] uint8 rows -> Fp8KVPool."""
    if rows.ndim != 2 or rows.shape[1] != ROW_BYTES or rows.dtype != jnp.uint8:
        raise ValueError(f"from_packed_u8 expects uint8 [N, {ROW_BYTES}], got {rows.dtype}{list(rows.shape)}")
    n = rows.shape[0]
    nope = jax.lax.bitcast_convert_type(rows[:, :NOPE_DIM], jnp.float8_e4m3fn)
    rope = jax.lax.bitcast_convert_type(rows[:, NOPE_DIM : NOPE_DIM + 2 * ROPE_DIM].reshape(n, ROPE_DIM, 2), jnp.bfloat16)
    return Fp8KVPool(nope=nope, rope=rope, scale=rows[:, NOPE_DIM + 2 * ROPE_DIM :])
