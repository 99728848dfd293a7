"""The Mosaic indexer kernel's q operand and head weights in one Pallas (Triton) kernel (MOSAIC_CONFIG q_prep).

    q_prep_fp8(q [R, H, 128] f32, w [R, H] f32, f16=True) -> (q_op [R, H, 128] f16 (or e4m3), w' [R, H] f32)
    q_prep_fp4(q [R, H, 128] f32, w [R, H] f32, perm [128, 128] f16, e5m2=False)
        -> (q_op [R, H, 128] f16 (or e5m2), w' [R, H] f32)

fp4 keys (session 42): q fake-quantized to fp4 (from a raw or an already fake-quantized q: the same values), divided
per head by 2^e into f16 and its channels moved to the key operand's columns; see `q_prep_fp4`. fp8 keys:

`gpu_mosaic.indexer_scores_mosaic` needs, per (query row, head), q's own fp8 quantization (`formats.quantize`:
e4m3 codes and a power-of-two scale s) with the codes as the wgmma operand and s folded into the head weight
(ReLU(s x) = s ReLU(x), s > 0). Written as jnp, XLA runs it as two or three small kernels a call (the per-head amax
reduction, the codes, w x s): ~1.2-2 us each at B = 64 plus the gaps between them (session 40's kernel list). This
kernel does it in one launch, one program per (query row, HEAD_BLOCK heads). Until session 54 a program took a
whole row (64 heads), and the fp4 kernel also multiplied by the identity permutation in the converter's rows
layout: 16-64 programs of 4 warps for a decode call, 6.1-6.5 us (fp4) and 2.4 us (fp8) on the H100; with 16 heads a
program and no identity MMA 2.3-2.8 and 1.8 us (CUPTI, `benchmarks/results/h100_s54r*_ikern.log`).

Equal to the XLA path bit for bit. The scale is formats' rule, s = 2^e with e = ceil(log2(max(amax, 1e-4) / 448)),
computed without the division (`_pow2_exponent_bits`): with max(amax, 1e-4) = m 2^E (m in [1, 2)), e = E - 8 +
(m > 1.75), since 448 = 1.75 x 2^8. (The rounded quotient never crosses a power of two the exact one does not: a float m 2^E above
1.75 x 2^(E) by one ulp gives a quotient 1.14 of its ulp above 2^(E - 8), which rounds up.) Codes: q x 2^-e (exact),
rounded to e4m3 (RNE, |.| <= 448 by the scale's choice), then to f16 (exact). The head weight: w x 2^e.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from .formats import E2M1_AMAX_FLOOR, E2M1_MAX, E4M3_AMAX_FLOOR, E4M3_MAX, FP4_BLOCK, FP4_Q_SHIFT, _exp2


def _rows_to_2d(x, shape):   # a per-row vector [rows] -> [rows, d] (broadcast_in_dim: Mosaic GPU's layouts have
    return jax.lax.broadcast_in_dim(x, shape, (0,))   # no [rows, 1] shape that `x[:, None]` would make)


def _pow2_exponent_bits(amax, fmt_max: float, floor: float):
    """`formats._pow2_exponent` without its division and frexp (Triton has neither): e = ceil(log2(max(amax, floor)
    / fmt_max)) for f32 amax >= 0. With fmt_max = m0 2^k (m0 in [1, 2)) and max(amax, floor) = m 2^E, e = E - k +
    (m > m0). Checked against formats' rule for fp8 (448 = 1.75 x 2^8) and fp4 (6 = 1.5 x 2^2): one ulp above m0
    the rounded quotient is 1.14 / 0.67 of its ulp above the power of two and rounds up, one ulp below it stays
    below (module doc)."""
    m0, k = math.frexp(fmt_max)
    m0, k = 2 * m0, k - 1
    threshold = int(round((m0 - 1) * 2 ** 23))      # m0's mantissa bits
    a = jnp.maximum(amax, jnp.float32(floor))
    bits = jax.lax.bitcast_convert_type(a, jnp.int32)
    E = ((bits >> 23) & 0xFF) - 127
    return E - k + ((bits & 0x7FFFFF) > threshold).astype(jnp.int32)


def fp8_q_operand_rows(q, w, f16: bool = True):
    """q [rows, d] f32, w [rows] f32 -> (codes [rows, d]: e4m3 codes of q x 2^-e, as f16 with f16, else
    float8_e4m3fn; w' = w x 2^e [rows] f32), e per row by the module doc's rule. As jnp that this module's Triton
    kernel and a Mosaic GPU kernel (gpu_mosaic's q_prep "fused") both lower."""
    e = _pow2_exponent_bits(jnp.max(jnp.abs(q), axis=1), E4M3_MAX, E4M3_AMAX_FLOOR)
    codes = (q * _rows_to_2d(_exp2(-e), q.shape)).astype(jnp.float8_e4m3fn)
    return (codes.astype(jnp.float16) if f16 else codes), w * _exp2(e)


def _kernel(q_ref, w_ref, qo_ref, wo_ref, *, f16):
    qo_ref[0], wo_ref[0] = fp8_q_operand_rows(q_ref[0], w_ref[0], f16)   # q [H, d], w [H]


# heads per program: a row's heads are split over programs, so a decode call of R rows runs R x H / HEAD_BLOCK programs
# (one program per row left 16-64 programs of 4 warps each to do a row's 64 x 128 values serially; module doc);
# 16: the permutation's MMA takes >= 16 rows
HEAD_BLOCK = 16


def _per_block(kernel, q, w, consts, q_dtype, name, num_warps, interpret, hb):
    """One program per (query row r, block of hb heads): kernel(q_ref [1, hb, d], w_ref [1, hb], *const_refs,
    qo_ref [1, hb, d] q_dtype, wo_ref [1, hb] f32), consts whole to every program. H is padded with zero heads to a
    multiple of the block (a power of two >= 16: a Triton block's dimensions are powers of two, and an MMA takes >= 16
    rows) and sliced off the outputs."""
    if hb < 16 or hb & (hb - 1):
        raise ValueError(f"q_prep: the head block must be a power of two >= 16, got {hb}")
    R, H0, d = q.shape
    hp = -(-H0 // hb) * hb
    q, w = q.astype(jnp.float32), w.astype(jnp.float32)
    if hp != H0:   # a zero head's operand and weight are 0
        q, w = jnp.pad(q, ((0, 0), (0, hp - H0), (0, 0))), jnp.pad(w, ((0, 0), (0, hp - H0)))
    extra = {}
    if not interpret:
        from jax.experimental.pallas import triton as pltriton

        extra = dict(compiler_params=pltriton.CompilerParams(num_warps=num_warps))
    whole = lambda c: pl.BlockSpec(c.shape, lambda r, j: (0,) * c.ndim)
    q_op, w_op = pl.pallas_call(
        kernel, grid=(R, hp // hb),
        in_specs=[pl.BlockSpec((1, hb, d), lambda r, j: (r, j, 0)), pl.BlockSpec((1, hb), lambda r, j: (r, j))]
                 + [whole(c) for c in consts],
        out_specs=[pl.BlockSpec((1, hb, d), lambda r, j: (r, j, 0)), pl.BlockSpec((1, hb), lambda r, j: (r, j))],
        out_shape=[jax.ShapeDtypeStruct((R, hp, d), q_dtype), jax.ShapeDtypeStruct((R, hp), jnp.float32)],
        interpret=interpret, name=name, **extra,
    )(q, w, *consts)
    return q_op[:, :H0], w_op[:, :H0]


def q_prep_fp8(q, w, f16: bool = True, interpret: bool = False, head_block: int = HEAD_BLOCK):
    """q [R, H, d] float32, w [R, H] float32 -> (q_op [R, H, d] (f16 codes, or e4m3 with f16=False), w' [R, H]
    f32): `gpu.quantize_q_fp8` + the weights' scale + the f16 conversion, in one kernel (module doc); head_block
    heads a program."""
    R, H0, d = q.shape
    if w.shape != (R, H0):
        raise ValueError(f"q_prep_fp8: w must be [R, H] = {(R, H0)}, got {w.shape}")
    if d & (d - 1):
        raise ValueError(f"q_prep_fp8: head_dim must be a power of two (a Triton block), got {d}")
    return _q_prep_fp8(q, w, f16=f16, interpret=interpret, hb=head_block)


@functools.partial(jax.jit, static_argnames=("f16", "interpret", "hb"))
def _q_prep_fp8(q, w, f16, interpret, hb):
    return _per_block(functools.partial(_kernel, f16=f16), q, w, (), jnp.float16 if f16 else jnp.float8_e4m3fn,
                      "indexer_q_prep_fp8", 4, interpret, hb)


# ---------------------------------------------------------------------------------------------------------------
# fp4 keys: q fake-quantized to fp4, scaled per head, its channels in the key operand's column order, in one kernel.


def _round_e2m1(y):
    """y f32 with |y| <= 6 -> y rounded to e2m1 (0, 0.5, 1, 1.5, 2, 3, 4, 6 and negatives), ties to the even code,
    as XLA's conversion to float4_e2m1fn, by integer ops on the bits (XLA folds the add-and-subtract-2^23 trick away):
    from 1 up e2m1 keeps one mantissa bit (the f32 mantissa rounded to its top bit, ties to even, a carry moving into
    the exponent); below 1 its values are 0, 0.5, 1 (ties 0.25 -> 0 and 0.75 -> 1, the even codes). The sign is put
    back by its bit (-0.0 stays -0.0)."""
    bits = jax.lax.bitcast_convert_type(y, jnp.int32)
    sign = bits & jnp.int32(-2 ** 31)
    mag = bits & jnp.int32(0x7FFFFFFF)
    a = jax.lax.bitcast_convert_type(mag, jnp.float32)
    normal = (mag + jnp.int32(0x1FFFFF) + ((mag >> 22) & 1)) & jnp.int32(-0x400000)   # ~0x3FFFFF
    small = jnp.where(a >= 0.75, jnp.float32(1.0), jnp.where(a > 0.25, jnp.float32(0.5), jnp.float32(0.0)))
    r = jnp.where(a >= 1.0, normal, jax.lax.bitcast_convert_type(small, jnp.int32))
    return jax.lax.bitcast_convert_type(r | sign, jnp.float32)


def _frexp_exponent(amax):
    """jnp.frexp(amax)[1] for finite f32 amax >= 0 (0 for 0), from the bits; subnormals scaled up by 2^32 first."""
    sub = amax < jnp.float32(2.0 ** -126)
    a = jnp.where(sub, amax * jnp.float32(2.0 ** 32), amax)
    E = (jax.lax.bitcast_convert_type(a, jnp.int32) >> 23) & 0xFF
    return jnp.where(amax > 0, E - 126 - jnp.where(sub, 32, 0), 0)


def fake_quantize_fp4_rows(q, column=None):
    """Inside a kernel: q [rows, d] f32 (channels in their own order) -> `formats.fake_quantize(q, "fp4")` exactly.
    Each element's group exponent comes from masked row maxima (2-D only: Triton has no tensor slices, and a TPU
    keeps the channels on its lanes), the rounding from `_round_e2m1`'s integer ops. Shared by this module's
    Triton kernel, the TPU indexer kernel (`tpu._prepare_fp4_q`) and the Mosaic GPU kernel's q_prep "fused"
    (`fp4_q_operand_e5m2_rows`). column: the channel index [rows, d] int32 (a Mosaic GPU kernel passes one in its
    register layout), default an iota."""
    rows, d = q.shape
    if column is None:
        column = jax.lax.broadcasted_iota(jnp.int32, (rows, d), 1)
    group = column // FP4_BLOCK
    mag = jnp.abs(q)
    e_el = jnp.zeros((rows, d), jnp.int32)
    for g in range(d // FP4_BLOCK):
        e_g = jnp.clip(_pow2_exponent_bits(jnp.max(jnp.where(group == g, mag, 0.0), axis=1), E2M1_MAX, E2M1_AMAX_FLOOR),
                       -127, 127)
        e_el = jnp.where(group == g, _rows_to_2d(e_g, (rows, d)), e_el)
    return _round_e2m1(q * _exp2(-e_el)) * _exp2(e_el)


def _fp4_q16(q, e5m2: bool, column=None):
    """q [rows, d] f32 (raw, or already fake-quantized to fp4) -> (q16 [rows, d] f16, e [rows] int32): q
    fake-quantized to fp4, divided per row by 2^e into f16. e: with e5m2 (the kernel's precision "fp8";
    `gpu.quantize_q_fp8`'s scale) the fp4 rule's exponent of the row's amax - FP4_Q_SHIFT, so the codes are e2m1 x 2^(e_g - e + 13), exact in f16 and
    in e5m2 while the row's groups span <= 28 binades; else frexp's exponent of its amax. column: as in
    `fake_quantize_fp4_rows`."""
    fq = fake_quantize_fp4_rows(q, column)
    if e5m2:
        e = jnp.clip(_pow2_exponent_bits(jnp.max(jnp.abs(fq), axis=1), E2M1_MAX, E2M1_AMAX_FLOOR), -100, 127)
        e = e - FP4_Q_SHIFT
    else:
        e = _frexp_exponent(jnp.max(jnp.abs(fq), axis=1))
    return (fq * _rows_to_2d(_exp2(-e), q.shape)).astype(jnp.float16), e


def fp4_q_operand_e5m2_rows(q, w, column=None):
    """q [rows, d] f32 (raw, or already fake-quantized to fp4), w [rows] f32 -> (codes [rows, d] float8_e5m2, w'
    [rows] f32): `_kernel_fp4(e5m2=True)`'s values without the permutation (the converter's rows layout), as jnp
    that a Mosaic GPU kernel lowers (gpu_mosaic's q_prep "fused": the scoring warpgroup prepares its own row's q).
    column: as in `fake_quantize_fp4_rows`."""
    q16, e = _fp4_q16(q, True, column)
    return q16.astype(jnp.float8_e5m2), w * _exp2(e)


def _kernel_fp4(q_ref, w_ref, *refs, e5m2=False):
    """refs: (perm_ref,)? + (qo_ref, wo_ref); without perm_ref the channels stay in their order."""
    *perm_ref, qo_ref, wo_ref = refs
    q16, e = _fp4_q16(q_ref[0], e5m2)              # [hb, d], channels in their own order; the head's scale
    if perm_ref:   # channels -> the key operand's columns: one f16 MMA with a 0/1 matrix, exact (one nonzero
        q16 = jnp.dot(q16, perm_ref[0][...], preferred_element_type=jnp.float32)   # product a column)
    qo_ref[0] = q16.astype(jnp.float8_e5m2 if e5m2 else jnp.float16)
    wo_ref[0] = w_ref[0] * _exp2(e)


def column_permutation(columns):
    """channel -> column map [d] -> the 0/1 matrix P [d, d] f16 with (x P)[:, columns[c]] = x[:, c]."""
    columns = np.asarray(columns)
    d = columns.shape[0]
    if sorted(columns.tolist()) != list(range(d)):
        raise ValueError(f"column_permutation: {columns} is not a permutation of range({d})")
    p = np.zeros((d, d), np.float16)
    p[np.arange(d), columns] = 1
    return jnp.asarray(p)


def q_prep_fp4(q, w, perm, e5m2: bool = False, interpret: bool = False, head_block: int = HEAD_BLOCK):
    """q [R, H, d] float32 (raw, or already fake-quantized to fp4: the same result), w [R, H] f32, perm [d, d] f16
    (`column_permutation`) or None (the channels in their own order, as the converter's rows layout takes them: no
    MMA) -> (q_op [R, H, d] f16, w' [R, H] f32): per (row, head), q fake-quantized to fp4 (`formats.fake_quantize`:
    e2m1 codes, one power-of-two scale per 32 channels), divided by 2^e (e: frexp's exponent of its largest
    magnitude) into f16, its channels moved to the key operand's columns; w' = w x 2^e.
    Equal bit for bit to `gpu_mosaic`'s jnp preparation of a fake-quantized q for |q| < 2^120.
    e5m2=True (the kernel's precision "fp8", session 45): q_op e5m2 codes of q / 2^(e - 13), e the fp4 rule's
    exponent of the head's amax (`gpu.quantize_q_fp8`), w' = w x 2^(e - 13); equal bit for bit to
    `gpu_mosaic.fp4_q_operand_e5m2`. head_block heads a program."""
    R, H0, d = q.shape
    if w.shape != (R, H0) or (perm is not None and perm.shape != (d, d)):
        raise ValueError(f"q_prep_fp4: w must be [R, H] = {(R, H0)} and perm [d, d] = {(d, d)} or None, got "
                         f"{w.shape}, {None if perm is None else perm.shape}")
    if d & (d - 1) or d % FP4_BLOCK:
        raise ValueError(f"q_prep_fp4: head_dim must be a power of two and a multiple of {FP4_BLOCK} (a Triton block "
                         f"of whole groups), got {d}")
    return _q_prep_fp4(q, w, perm, e5m2=e5m2, interpret=interpret, hb=head_block)


@functools.partial(jax.jit, static_argnames=("e5m2", "interpret", "hb"))
def _q_prep_fp4(q, w, perm, e5m2, interpret, hb):
    consts = () if perm is None else (perm.astype(jnp.float16),)
    return _per_block(functools.partial(_kernel_fp4, e5m2=e5m2), q, w, consts,
                      jnp.float8_e5m2 if e5m2 else jnp.float16, "indexer_q_prep_fp4" + ("_e5m2" if e5m2 else ""),
                      4, interpret, hb)
