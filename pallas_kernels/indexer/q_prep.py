"""The Mosaic indexer kernel's q operand and head weights for fp8 keys in one Pallas (Triton) kernel.

    q_prep_fp8(q [R, H, 128] f32, w [R, H] f32, f16=True) -> (q_op [R, H, 128] f16 (or e4m3), w' [R, H] f32)

`gpu_mosaic.indexer_scores_mosaic` needs, per (query row, head), q's own fp8 quantization (`formats.quantize`:
e4m3 codes and a power-of-two scale s) with the codes as the wgmma operand and s folded into the head weight
(ReLU(s x) = s ReLU(x), s > 0). Written as jnp, XLA runs it as two or three small kernels a call (the per-head amax
reduction, the codes, w x s): ~1.2-2 us each at B = 64 plus the gaps between them (session 40's kernel list). This
kernel does it in one launch, one program per query row.

Equal to the XLA path bit for bit. The scale is formats' rule, s = 2^e with e = ceil(log2(max(amax, 1e-4) / 448)),
computed without the division: with max(amax, 1e-4) = m 2^E (m in [1, 2)), e = E - 8 + (m > 1.75), since 448 =
1.75 x 2^8. (The rounded quotient never crosses a power of two the exact one does not: a float m 2^E above
1.75 x 2^(E) by one ulp gives a quotient 1.14 of its ulp above 2^(E - 8), which rounds up.) Codes: q x 2^-e (exact),
rounded to e4m3 (RNE, |.| <= 448 by the scale's choice), then to f16 (exact). The head weight: w x 2^e.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .formats import _exp2

E4M3_FLOOR = 1e-4   # formats.quantize's floor on the amax (fp8)


def _scale_exponent(amax):
    """e = ceil(log2(max(amax, 1e-4) / 448)) for f32 amax >= 0, by the exponent and mantissa bits (no division)."""
    a = jnp.maximum(amax, jnp.float32(E4M3_FLOOR))
    bits = jax.lax.bitcast_convert_type(a, jnp.int32)
    E = ((bits >> 23) & 0xFF) - 127
    above = (bits & 0x7FFFFF) > 0x600000          # mantissa m > 1.75 (1.75 = 1 + 0x600000 / 2^23)
    return E - 8 + above.astype(jnp.int32)


def _kernel(q_ref, w_ref, qo_ref, wo_ref, *, f16):
    q = q_ref[0]                                   # [H, d]
    e = _scale_exponent(jnp.max(jnp.abs(q), axis=1))
    codes = (q * _exp2(-e)[:, None]).astype(jnp.float8_e4m3fn)
    qo_ref[0] = codes.astype(jnp.float16) if f16 else codes
    wo_ref[0] = w_ref[0] * _exp2(e)


@functools.partial(jax.jit, static_argnames=("f16", "interpret"))
def q_prep_fp8(q, w, f16: bool = True, interpret: bool = False):
    """q [R, H, d] float32, w [R, H] float32 -> (q_op [R, H, d] (f16 codes, or e4m3 with f16=False), w' [R, H]
    f32): `gpu.quantize_q_fp8` + the weights' scale + the f16 conversion, in one kernel (module doc)."""
    R, H, d = q.shape
    if w.shape != (R, H):
        raise ValueError(f"q_prep_fp8: w must be [R, H] = {(R, H)}, got {w.shape}")
    if H & (H - 1) or d & (d - 1):
        raise ValueError(f"q_prep_fp8: heads and head_dim must be powers of two (Triton blocks), got {H}, {d}")
    extra = {}
    if not interpret:
        from jax.experimental.pallas import triton as pltriton

        extra = dict(compiler_params=pltriton.CompilerParams(num_warps=4 if H * d <= 8192 else 8))
    return pl.pallas_call(
        functools.partial(_kernel, f16=f16), grid=(R,),
        in_specs=[pl.BlockSpec((1, H, d), lambda r: (r, 0, 0)), pl.BlockSpec((1, H), lambda r: (r, 0))],
        out_specs=[pl.BlockSpec((1, H, d), lambda r: (r, 0, 0)), pl.BlockSpec((1, H), lambda r: (r, 0))],
        out_shape=[jax.ShapeDtypeStruct((R, H, d), jnp.float16 if f16 else jnp.float8_e4m3fn),
                   jax.ShapeDtypeStruct((R, H), jnp.float32)],
        interpret=interpret, name="indexer_q_prep_fp8", **extra,
    )(q.astype(jnp.float32), w.astype(jnp.float32))
