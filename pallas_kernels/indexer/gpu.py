"""GPU Pallas (Triton backend) lightning-indexer scores kernel + top-k; the contract is `reference.indexer_topk`.
(`kernel="mosaic"` routes fp8-key scores to the Mosaic GPU kernel of `gpu_mosaic.py` instead; see `resolve_kernel`.)

Scores kernel: one program = (batch row b, block of `block_q` queries, split of the key range). q / w of the block
stay in registers while the program sweeps its split's `block_t`-key blocks in a `fori_loop` (Triton software-
pipelines the key loads, `num_stages`); per block it loads the keys once (dequantizing in registers: bf16 / f32
rows; fp8 e4m3 rows whose per-key power-of-two scale is applied to the [block_t] result since ReLU(s x) = s ReLU(x)
for s > 0; fp4 packed e2m1 nibbles turned into bf16 by bit arithmetic with the ue8m0 block scale folded into the
exponent), then for each query computes logits = K q^T [block_t, H] on the tensor cores, ReLU, the head-weighted
sum and the causal mask (t < n_visible, -inf otherwise), and stores one score row segment. Blocks past the last
key any query of the block can see are not read: a second loop writes -inf there. Decode (block_q = 1) gets
enough splits for ~`waves` x 132 programs, so one long sequence is spread over the whole GPU.

fp4 de-interleave: byte j holds elements 2j (low nibble) and 2j+1 (high nibble); instead of interleaving the
decoded nibbles the kernel splits q into its even and odd channels outside (tiny) and does two [block_t, dI/2]
dots, one per nibble. The per-32-element scale byte is broadcast over its 16 bytes either by a gather load
(`fp4_scale="gather"`) or by loading [block_t, dI/32] and reshaping (`"reshape"`).

Precision ("precision" option): "bf16" (bf16 operands, f32 accumulate; exact products for fp8 / fp4 keys with
fake-quantized queries, which are bf16-representable), "bf16x2" (q split into bf16 hi + lo: ~16-bit mantissa, for
bf16 keys and float queries), "f32" (fp32 FMA dot, no tf32), "f16" (fp8 / fp4 keys: f16 operands. fp8: e4m3 -> f16
in one conversion; fp4: `fp4_to_f16_scaled` (5 integer ops per value, e2m1 x 2^-14 exactly), two K=16 dots per 32-channel
scale group with the group's scale applied to their f32 sum (or, `fp4_scale_at="operand"`, the default, on the f16
operands relative to the key's largest group scale, which multiplies the score; a group 2^23 or more below its key's
largest loses bits there); exact for the keys (fp4: block exponents <= 113),
fake-quantized q entries outside f16's range (below 2^-24, above 65504) flush / overflow), "fp8" (fp8 / fp4 keys: fp8
tensor-core operands with q quantized like the keys (`quantize_q_fp8`, its scale folded into the head weights): fp8
keys go to the MMA as stored (e4m3), fp4 nibbles are moved to e5m2 by bit arithmetic (`fp4_to_e5m2_scaled`) and
re-interleaved by a join, one K=32 dot per scale group; exact for q fake-quantized like the keys. Correct on the
H200 but slower there (session 10, B = 64, 128K context, scores kernel: fp8 keys 203.9 vs 131.2 us with "f16",
fp4 keys 266.5 vs 222.4), so not a default). Defaults: None -> "f32", bf16 -> "bf16x2", fp8 -> "f16", fp4 -> "f16"
(23% faster than "bf16" on the H200, session 7).

Top-k ("topk" option): "lax" = `lax.top_k` over each query's [T] scores (XLA), "blockwise" = `lax.top_k` per
`topk_block` candidates then over the concatenated survivors (ties still go to the lower index), "radix" /
"radix4" = exact radix select (`topk.topk_radix`, 8 / 4 bits per pass; no sort over T; "radix_bits" overrides the
digit width), "grouped" / "grouped<N>" = exact two-stage selection (`topk.topk_grouped`: top-k groups of N = 32
scores by their max, then top-k over those k * N candidates), "threshold" = `topk.topk_threshold` (a provable lower
bound of the k-th score from strided-group maxima, the survivors compacted by a Triton kernel on GPU (XLA cumsum
elsewhere), lax.top_k over ~4k slots; a row that overflows the slots gets its exact top-k set from the
`topk.exact_rows` fix-up kernel, so the GPU path has no conditional), "threshold_rank" = the same with a Triton
rank-counting kernel instead of the two lax.top_k (no sort; measured slower at batch 64), "threshold_select" = Triton
kernels for the bound and for picking the k-set among the survivors (`topk_threshold(impl="pallas_select")`; the only
sort left is over the k picks), "threshold_set" = the same without that sort: the picks as an index set (ascending
index, -1s last), for consumers that only gather and sum; "threshold_fused" / "threshold_fused_set" = the
threshold_select / threshold_set selection as one Triton kernel, one program per row (`topk_fused.fused_select`:
no launches between its stages), "threshold_regions" / "threshold_regions_set" = the same in two Triton kernels
(`topk_regions.regions_select`; session 30, slower: 159 vs 136 us per fp8 indexer call at B = 64 x 128K), "hist" /
"hist_set" = no bound and no compaction chain: one Triton program per row selects the k-set by radix select with
11-bit histogram digits (`topk_hist.hist_select`, Triton's tt.histogram; session 33: 131.6 vs 135.0 us per fp8 call
at B = 64 x 128K, but 1036 vs 848 at 1M and 286 vs 32 us for one row of 262,144, where one SM per row idles the
GPU; so not a default on their own), "tour" / "tour_set" = the same kernel as a tournament: segments of 4096
candidates keep their own top-k sets (one program each, so a few long rows still fill the GPU), then one program per
row selects among the survivors (`topk_hist.tournament_select`, session 36; `topk_hist.TOUR_CONFIG["fuse_final"]`
runs its last segment stage and the final selection as one kernel, session 38: slower on the H200, off),
"auto_set" = "hist_set" for rows of
2048-16384 candidates (8K-64K context) and for calls of >= 96 rows of up to 32768 (128K context), "tour_set" for
longer rows where a call holds <= 2^21 candidates, "threshold_set" elsewhere (`resolve_set_method`; the model's GPU
default since session 34; since session 57 "segment_set" for fp8 / fp4 keys at 128K context up to 128 rows a call,
`auto_set_method`). "segment_set" = the tournament's first stage inside the Mosaic scores kernel:
each CTA selects its split's top-k superset from its scores in shared memory and writes only that
(`mosaic_select`, session 40), then the row's set among the survivors: in the same kernel (the
row's splits as one thread-block cluster) or one Triton program per row (`segment_topk`, `gpu_mosaic.SELECT_CONFIG`).
All others give the same picks. H200, session 7 (B = 64, 128K context, bf16 keys, whole pipeline): default
218-224 us, threshold_select 220, threshold_set 210-212 (the only one with no sort left).
Default "threshold": on the H200, 44 us at batch 1 x 262,144 candidates (lax.top_k ~80) and 55-60 us at batch 64 x
32K (lax ~260), the chain harness included (results/README_indexer_compressor.md, session 5). Scores are
materialized per query chunk only ([B, query_chunk, T] f32), so prefill memory stays bounded.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

try:
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover
    plgpu = None

from . import formats
from .topk import INT32_MIN, _ordered_i32, producer_groups
from ..numerics import round_to_bf16
from ..chunking import map_query_chunks
from ..dispatch import kernel_platform

N_SM_H200 = 132
# fp8 -> f16: measured 18% faster than bf16 operands (session 5); fp4 -> f16: 222.6 vs 289.5 us for the scores at
# B = 64, 128K context, 64 x 4 tiles (session 7, results/h200_s7r3_idx_fp4_f16.log), and exact for the keys
DEFAULT_PRECISION = {None: "f32", "bf16": "bf16x2", "fp8": "f16", "fp4": "f16"}


def key_format_of(keys) -> Optional[str]:
    if isinstance(keys, formats.QuantizedKeys):
        return keys.fmt
    return "bf16" if keys.dtype == jnp.bfloat16 else None


N_TERMS = {"f32": 1, "bf16": 1, "bf16x2": 2, "f16": 1, "fp8": 1}  # q operand terms per precision (bf16x2: hi + lo)
OP_DTYPE = {"f32": jnp.float32, "bf16": jnp.bfloat16, "bf16x2": jnp.bfloat16, "f16": jnp.float16,
            "fp8": jnp.float8_e4m3fn}
FP4_Q_SHIFT = formats.FP4_Q_SHIFT   # precision="fp8", fp4 keys: q / 2^(e_max - 13) (formats' note)


def fp8_operand_dtype(fmt):
    """precision="fp8": fp8 keys stay e4m3; fp4 keys become e5m2 (the bit move of `fp4_to_e5m2_scaled`)."""
    return jnp.float8_e5m2 if fmt == "fp4" else jnp.float8_e4m3fn


def quantize_q_fp8(q, fmt):
    """precision="fp8": q [..., H, d] float32 -> (fp8 operand [..., H, d], per-(token, head) power-of-two scale
    [..., H] that the caller folds into the head weights; ReLU(s x) = s ReLU(x) for s > 0).

    fp8 keys: q's own fp8 quantization (formats.quantize, e4m3 + one scale per (token, head)), which reproduces a
    fp8-fake-quantized q exactly. fp4 keys: q / 2^(e - 13) in e5m2, e = the fp4 rule's exponent of the head's amax
    (= its largest group exponent). A fp4-fake-quantized q is code_g x 2^e_g with e2m1 codes (<= 2 significant bits),
    so every value is exact in e5m2 as long as the head's group exponents span <= 28 binades. Other q are rounded to
    the operand format (the error of vLLM's fp8 indexer q)."""
    if fmt == "fp8":
        qk = formats.quantize(q, "fp8")
        return qk.values, qk.scale[..., 0]
    amax = jnp.max(jnp.abs(q), axis=-1)
    e = jnp.clip(formats._pow2_exponent(amax, formats.E2M1_MAX, formats.E2M1_AMAX_FLOOR), -100, 127)
    s = formats._exp2(e - FP4_Q_SHIFT)
    return (q / s[..., None]).astype(jnp.float8_e5m2), s


def split_q(q, fmt, precision):
    """q [..., H, dI] float32 -> list of operand arrays (bf16 / f32), fp4: even/odd channels interleave undone.
    precision="fp8": q is already the fp8 operand (`quantize_q_fp8`); fp4 keys: one [.., 32] part per scale group
    in natural channel order (the kernel re-interleaves the key nibbles)."""
    if precision == "fp8":
        parts = [q[..., 32 * g:32 * g + 32] for g in range(q.shape[-1] // 32)] if fmt == "fp4" else [q]
        return parts, 1
    if fmt == "fp4" and precision == "f16":  # per 32-channel scale group g: its even and odd channels
        ev, od = q[..., 0::2], q[..., 1::2]
        parts = [x for g in range(q.shape[-1] // 32)
                 for x in (ev[..., 16 * g:16 * g + 16], od[..., 16 * g:16 * g + 16])]
    elif fmt == "fp4":
        parts = [q[..., 0::2], q[..., 1::2]]
    else:
        parts = [q]
    if precision == "f32":
        return [p.astype(jnp.float32) for p in parts], N_TERMS[precision]
    if precision in ("bf16", "f16"):
        return [p.astype(OP_DTYPE[precision]) for p in parts], N_TERMS[precision]
    # hi = p rounded to bf16, lo = the exact f32 remainder rounded to bf16: ~16-bit mantissa in all. The rounding
    # is bit arithmetic (numerics.round_to_bf16): with two casts XLA GPU folds float32(bfloat16(p)) back to p
    # under jit, which made lo = 0 and the prefill picks wrong on the H200 (session 4).
    hi32 = [round_to_bf16(p) for p in parts]
    hi = [h.astype(jnp.bfloat16) for h in hi32]
    lo = [(p - h).astype(jnp.bfloat16) for p, h in zip(parts, hi32)]
    return hi + lo, N_TERMS[precision]


def e2m1_value(code):
    """e2m1 code (int32 0..15) -> float32 value."""
    mag = code & 7
    e = mag >> 1
    m = (mag & 1).astype(jnp.float32)
    sub = 0.5 * m
    nrm = (1.0 + 0.5 * m) * jax.lax.bitcast_convert_type((e - 1 + 127) << 23, jnp.float32)
    v = jnp.where(e == 0, sub, nrm)
    return jnp.where((code & 8) != 0, -v, v)


def _dot_nt(a, b, precision):
    if precision == "f32":
        return plgpu.dot(a, b, trans_b=True, allow_tf32=False)
    return plgpu.dot(a, b, trans_b=True)


def fp4_to_bf16(code, sb):
    """e2m1 codes (int32 0..15) x 2^(sb - 127) (sb: ue8m0 byte, int32) -> bfloat16, by bit arithmetic: the
    exponent field is (code's exponent) + sb - 1 and the mantissa bit moves to bf16 bit 6; the e2m1 subnormal
    (0.5) and zero are special-cased. Exact for sb >= 2 (any real key block; sb <= 1 only for all-zero blocks,
    where the 0.5 * 2^-126 code would flush to 0)."""
    mag = code & 7
    base = (sb - 1) << 7
    bits = jnp.where(mag >= 2, (mag << 6) + base, jnp.where(mag == 1, base, 0))
    bits = bits | ((code & 8) << 12)
    return jax.lax.bitcast_convert_type(bits.astype(jnp.int16), jnp.bfloat16)


def fp4_to_f16_scaled(byte):
    """Packed e2m1 bytes (int32 0..255) -> (low-nibble, high-nibble) float16 values, each = e2m1 value x 2^-14
    EXACTLY: the nibble's 3 magnitude bits land on f16 bits 11..9 (exponent field = the e2m1 exponent, mantissa
    bit = its mantissa bit), so normal codes map to 2^(e-1)(1 + m/2) x 2^-14 and the e2m1 subnormal (0.5) to f16's
    subnormal 2^-15 -- no special cases; the sign moves to bit 15. 5 integer ops per value (the bf16 route with the
    scale folded into the exponent needs ~10 and two selects)."""
    lo = ((byte & 0x7) << 9) | ((byte & 0x8) << 12)
    hi = ((byte & 0x70) << 5) | ((byte & 0x80) << 8)
    cast = lambda v: jax.lax.bitcast_convert_type(v.astype(jnp.int16), jnp.float16)
    return cast(lo), cast(hi)


# fp4_decode="asm": four packed e2m1 bytes (one 32-bit register $2, byte i = key channels 2i / 2i+1 of a 16-byte
# group) -> their four low (or high) nibbles as 2 f16x2 registers ($0, $1), each value = e2m1 x 2^-14 exactly as
# `fp4_to_f16_scaled`. A byte permute spreads bytes (0, 1) / (2, 3) to the two 16-bit halves of a word; then per
# register two shifts, two masks and an or (ptxas fuses mask + or into LOP3): ~8 instructions per 4 values, against
# ~6 per value for the int32 route (byte extraction, 5 ops, f16x2 packing). Two asm instances (low, high): jax's
# Triton lowering of elementwise_inline_asm returns one result only (jax 0.10).
_FP4_F16X2_ASM = """{{
.reg .b32 t0, t1, a, b;
prmt.b32 t0, $2, 0, 0x4140;
prmt.b32 t1, $2, 0, 0x4342;
shl.b32 a, t0, {m};  and.b32 a, a, 0x0E000E00; shl.b32 b, t0, {s}; and.b32 b, b, 0x80008000; or.b32 $0, a, b;
shl.b32 a, t1, {m};  and.b32 a, a, 0x0E000E00; shl.b32 b, t1, {s}; and.b32 b, b, 0x80008000; or.b32 $1, a, b;
}}"""
FP4_F16X2_ASM = dict(lo=_FP4_F16X2_ASM.format(m=9, s=12), hi=_FP4_F16X2_ASM.format(m=5, s=8))
FP4_DECODES = ("alu", "asm")
FP4_SCALE_AT = ("result", "operand")


def fp4_to_f16_scaled_asm(raw):
    """`fp4_to_f16_scaled` on uint8 bytes [...] -> (low, high) float16 [...] through FP4_F16X2_ASM (4 bytes per asm
    instance). Inline PTX: compiled kernels only (no interpreter)."""
    shape = jax.ShapeDtypeStruct(raw.shape, jnp.float16)
    return tuple(plgpu.elementwise_inline_asm(FP4_F16X2_ASM[h], args=[raw], constraints="=r,=r,r", pack=4,
                                              result_shape_dtypes=[shape])[0] for h in ("lo", "hi"))


def fp4_to_e5m2_scaled(byte):
    """Packed e2m1 bytes (int32 0..255) -> [..., 2 x n] float8_e5m2 in natural element order (low nibble first), each
    = e2m1 value x 2^-14 EXACTLY: the nibble's 3 magnitude bits land on e5m2 bits 3..1 (exponent field = the e2m1
    exponent, mantissa bit = its mantissa bit; the e2m1 subnormal 0.5 becomes e5m2's subnormal 2^-15), the sign on
    bit 7. 3-4 integer ops per value, no conversion instruction; the two nibbles of a byte are re-interleaved by a
    join (stack on the last axis + reshape)."""
    lo = ((byte & 0x7) << 1) | ((byte & 0x8) << 4)
    hi = ((byte >> 3) & 0xE) | (byte & 0x80)
    both = jnp.stack([lo.astype(jnp.uint8), hi.astype(jnp.uint8)], axis=-1)
    both = both.reshape(byte.shape[:-1] + (2 * byte.shape[-1],))
    return jax.lax.bitcast_convert_type(both, jnp.float8_e5m2)


def _kernel(nvis_ref, w_ref, *refs, fmt, n_qparts, n_terms, block_q, block_t, T, d, precision, op_dtype,
            blocks_per_split, n_blocks, fp4_scale, heads_major=False, gmax_groups=0, fp4_decode="alu",
            fp4_scale_at="result"):
    q_refs = refs[:n_qparts]
    rest = refs[n_qparts:]
    n_out = 2 if gmax_groups else 1
    o_ref = rest[-n_out]
    g_ref = rest[-1] if gmax_groups else None   # [B, Sp, n_split, G] partial strided-group maxima (ordered keys)
    key_refs = rest[:-n_out]
    b = pl.program_id(0)
    qi = pl.program_id(1)
    sp = pl.program_id(2)
    nvis = nvis_ref[...]                                   # [block_q] int32
    lim = jnp.minimum(jnp.max(nvis), T)                     # no query of the block sees a key >= lim
    nb_live = (lim + block_t - 1) // block_t
    lo = sp * blocks_per_split
    hi = jnp.minimum(lo + blocks_per_split, n_blocks)
    live_hi = jnp.clip(nb_live, lo, hi)
    per = 2 if fmt == "fp4" else 1
    fp8_ops = precision == "fp8"                            # fp8 tensor-core operands (no key conversion for fp8)
    fp4_groups = fmt == "fp4" and (op_dtype == jnp.float16 or fp8_ops)  # per-32-channel-group dots, scales on results
    fp4_on_operand = fp4_groups and fp4_scale_at == "operand"   # or: scales on the f16 operands, one per-key scale
    # q and w of the block stay in registers / shared memory for the whole sweep over this split's key blocks
    # (block_q is sized so that is <= 128 KB: see default_config)
    hoisted = [[q_ref[qq, :, :] if fp8_ops else q_ref[qq, :, :].astype(op_dtype) for q_ref in q_refs]
               for qq in range(block_q)]
    ws = [w_ref[qq, :].astype(jnp.float32) for qq in range(block_q)]
    out_rows = [qi * block_q + qq for qq in range(block_q)]

    def load_keys(rows, live):
        """Key block -> (operands [block_t, w] in op_dtype, per-key scale or None)."""
        live2 = live[:, None]
        if fmt in (None, "bf16"):
            cols = jax.lax.broadcasted_iota(jnp.int32, (1, d), 1)
            k = plgpu.load(key_refs[0].at[b, rows[:, None], cols], mask=live2, other=0.0)
            return [k.astype(op_dtype)], None
        if fmt == "fp8":  # per-key power-of-two scale applied to the [block_t] score: ReLU(s x) = s ReLU(x)
            cols = jax.lax.broadcasted_iota(jnp.int32, (1, d), 1)
            k = plgpu.load(key_refs[0].at[b, rows[:, None], cols], mask=live2)
            sc = plgpu.load(key_refs[1].at[b, rows, jnp.zeros_like(rows)], mask=live, other=0.0)
            if fp8_ops:                  # e4m3 keys straight into the e4m3 x e4m3 MMA
                return [k], sc
            if op_dtype == jnp.float16:  # e4m3 is exact in f16: one conversion instead of e4m3 -> f32 -> bf16
                return [k.astype(jnp.float16)], sc
            return [k.astype(jnp.float32).astype(op_dtype)], sc
        if fp4_groups:  # fp4 via f16 / e5m2: per 32-channel group, its 16 bytes and one scale byte per key
            ops, sbs = [], []
            cols16 = jax.lax.broadcasted_iota(jnp.int32, (1, 16), 1)
            for g in range(d // 32):
                raw = plgpu.load(key_refs[0].at[b, rows[:, None], 16 * g + cols16], mask=live2, other=0)
                if fp8_ops:   # one [block_t, 32] e5m2 operand per group (= value x 2^-14, like the f16 route)
                    ops.append([fp4_to_e5m2_scaled(raw.astype(jnp.int32))])
                elif fp4_decode == "asm":
                    ops.append(list(fp4_to_f16_scaled_asm(raw)))   # the stored uint8 bytes, 4 per register
                else:
                    ops.append(list(fp4_to_f16_scaled(raw.astype(jnp.int32))))
                sbs.append(plgpu.load(key_refs[1].at[b, rows, jnp.full_like(rows, g)], mask=live,
                                      other=127).astype(jnp.int32))
            pow2 = lambda e: jax.lax.bitcast_convert_type(e << 23, jnp.float32)   # f32 exponent field e -> 2^(e-127)
            if fp4_on_operand:
                # per key, its largest group scale byte `top`; group g's f16 operands (e2m1 x 2^-14) times
                # 2^(sb_g - top + 14) <= 2^14 = e2m1 x 2^(sb_g - top), exact down to f16's subnormals (a group 2^23
                # or more below its key's largest group loses bits: its share of the score is under f32 rounding
                # anyway); the key's 2^(top - 127) multiplies its score after the head sum (ReLU(s x) = s ReLU(x),
                # s > 0). One multiply per operand value instead of one per [block_t, H] logit and group.
                top = functools.reduce(jnp.maximum, sbs)
                kops = []
                for ops_g, sb in zip(ops, sbs):
                    factor = pow2(jnp.clip(sb - top + 14 + 127, 0, 255)).astype(jnp.float16)[:, None]
                    kops += [v * factor for v in ops_g]
                return kops, pow2(jnp.maximum(top, 1))
            # 2^(sb - 127) x 2^14 (undoing the decode's 2^-14); sb = 0 only for all-zero blocks (codes 0)
            return [v for ops_g in ops for v in ops_g], [pow2(jnp.maximum(sb, 1)) * 16384.0 for sb in sbs]
        half = d // 2                                      # fp4: byte j = elements 2j (low) and 2j+1 (high)
        cols = jax.lax.broadcasted_iota(jnp.int32, (1, half), 1)
        raw = plgpu.load(key_refs[0].at[b, rows[:, None], cols], mask=live2, other=0).astype(jnp.int32)
        if fp4_scale == "gather":
            sb = plgpu.load(key_refs[1].at[b, rows[:, None], cols // 16], mask=live2, other=127)
        else:  # [block_t, d/32] scales, broadcast over their 16 bytes each
            n_g = d // 32
            g = jax.lax.broadcasted_iota(jnp.int32, (1, n_g), 1)
            sb = plgpu.load(key_refs[1].at[b, rows[:, None], g], mask=live2, other=127)
            sb = jnp.broadcast_to(sb[:, :, None], (block_t, n_g, 16)).reshape(block_t, half)
        sb = sb.astype(jnp.int32)
        lo_k, hi_k = fp4_to_bf16(raw & 0xF, sb), fp4_to_bf16(raw >> 4, sb)
        return [lo_k.astype(op_dtype), hi_k.astype(op_dtype)], None

    # Strided-group maxima for the threshold top-k (gmax_groups = G, a multiple of block_t): column t is in group
    # t % G, so block j's columns are groups (j % P) * block_t + [0, block_t) with P = G / block_t; the program keeps
    # one running max [block_t] per phase p of j % P and query, and writes them as its partial maxima
    P = gmax_groups // block_t if gmax_groups else 0

    def track(j, carry, qq, stored):
        if not P:
            return carry
        key = _ordered_i32(stored)
        accs = tuple(jnp.where(j % P == p, jnp.maximum(a, key), a) for p, a in enumerate(carry[qq]))
        return carry[:qq] + (accs,) + carry[qq + 1:]

    def body(j, carry):
        rows = j * block_t + jax.lax.iota(jnp.int32, block_t)
        live = rows < lim
        kops, scale = load_keys(rows, live)
        group_scales, row_scale = (scale, None) if fp4_groups and not fp4_on_operand else (None, scale)
        # logits [block_t, H] = K q^T (keys on the MMA's M side), or [H, block_t] = q K^T with heads_major (the
        # keys on the N side: one m64 x n<block_t> tile per warpgroup instead of n64 tiles)
        kdot = (lambda k_, q_: _dot_nt(q_, k_, precision)) if heads_major else (
            lambda k_, q_: _dot_nt(k_, q_, precision))
        per_key = (lambda v: v[None, :]) if heads_major else (lambda v: v[:, None])
        per_head = (lambda v: v[:, None]) if heads_major else (lambda v: v[None, :])
        for qq in range(block_q):
            qv, wv = hoisted[qq], ws[qq]
            logits = None
            if fp4_on_operand:  # sum_g (lo_g' . q_even_g + hi_g' . q_odd_g), the scales already in the operands
                for kop, qop in zip(kops, qv):
                    x = kdot(kop, qop)
                    logits = x if logits is None else logits + x
            elif fp4_groups:  # sum_g s_g[t] (lo_g . q_even_g + hi_g . q_odd_g), fp8: s_g[t] (k_g . q_g); n_terms == 1
                for g, sg in enumerate(group_scales):
                    if fp8_ops:
                        x = kdot(kops[g], qv[g])
                    else:
                        x = kdot(kops[2 * g], qv[2 * g]) + kdot(kops[2 * g + 1], qv[2 * g + 1])
                    x = x * per_key(sg)
                    logits = x if logits is None else logits + x
            for t in range(0 if fp4_groups else n_terms):
                for p in range(per):
                    x = kdot(kops[p], qv[t * per + p])
                    logits = x if logits is None else logits + x
            s = jnp.sum(jnp.maximum(logits, 0.0) * per_head(wv), axis=0 if heads_major else 1)
            if row_scale is not None:
                s = s * row_scale
            vis = rows < jnp.minimum(nvis_ref[qq], T)   # a ref load: static slices of values don't lower
            stored = jnp.where(vis, s, -jnp.inf)
            plgpu.store(o_ref.at[b, jnp.full_like(rows, out_rows[qq]), rows], stored)
            carry = track(j, carry, qq, stored)
        return carry

    def fill(j, carry):  # blocks past every query's visible range: -inf without reading keys
        rows = j * block_t + jax.lax.iota(jnp.int32, block_t)
        for qq in range(block_q):
            stored = jnp.full((block_t,), -jnp.inf, jnp.float32)
            plgpu.store(o_ref.at[b, jnp.full_like(rows, out_rows[qq]), rows], stored)
            carry = track(j, carry, qq, stored)
        return carry

    init = tuple(tuple(jnp.full((block_t,), INT32_MIN, jnp.int32) for _ in range(P)) for _ in range(block_q))
    carry = jax.lax.fori_loop(lo, live_hi, body, init if P else 0)
    carry = jax.lax.fori_loop(live_hi, hi, fill, carry)
    if P:
        lanes = jax.lax.iota(jnp.int32, block_t)
        for qq in range(block_q):
            for p in range(P):
                plgpu.store(g_ref.at[b, jnp.full_like(lanes, out_rows[qq]), jnp.full_like(lanes, sp),
                                     p * block_t + lanes], carry[qq][p])


def default_config(S, T, q_bytes, key_bytes=2):
    """Decode (S == 1) over bf16 keys with T >= 2048: one query per program, 256-key blocks on 8 warps; every other
    case 64-key blocks on 4 warps. Enough splits of the key range that the grid holds ~4 waves of programs; each
    program sweeps its split in a pipelined loop. Session 6 sweeps on the H200 (B = 64, 128K context, scores kernel
    alone, us): bf16 keys 256 x 8 warps 174-177, 128 x 4 185, 64 x 4 192-195, 64 x 8 391; fp8 keys 64 x 4 131 but
    256 x 8 176; fp4 64 x 4 288, 256 x 8 345 (results/README_indexer_compressor.md). Prefill: up to 8 queries share
    each loaded key block, fewer when their hoisted q operands (`q_bytes` per query) would exceed 128 KB (8 f32 /
    bf16x2 queries of 64 x 128 ran out of shared memory on the H200); `key_bytes` = bytes per key element as stored
    (f32 4, bf16 2, fp8 1, fp4 0.5). heads_major (False): see `indexer_scores_gpu`."""
    block_q = 1 if S == 1 else max(1, min(8, (128 << 10) // q_bytes))
    wide = S == 1 and key_bytes == 2 and T >= 2048   # short rows keep the small blocks (few blocks per split)
    block_t = 256 if wide else 64
    block_t = min(block_t, max(16, 1 << (max(T, 1) - 1).bit_length()))
    return dict(block_q=block_q, block_t=max(16, block_t), num_warps=8 if wide else 4, num_stages=3, waves=4,
                fp4_scale="gather", heads_major=False, fp4_decode=None, fp4_scale_at=None)


def default_fp4_decode(fmt, precision, block_t, num_warps, interpret):
    """"asm" where the packed inline PTX applies (compiled kernel, fp4 keys as f16 operands, a [block_t, 16] byte
    tile giving each thread the 4 bytes an asm instance takes), else "alu"."""
    fits = fmt == "fp4" and precision == "f16" and block_t * 16 >= 4 * 32 * num_warps
    return "asm" if fits and not interpret else "alu"


def default_fp4_scale_at(fmt, precision):
    """"operand" for fp4 keys as f16 operands (the group scales ride on the key operands: 16-18% faster than on the
    logits on the H200, session 14), else "result" (the only placement other formats / precisions have)."""
    return "operand" if fmt == "fp4" and precision == "f16" else "result"


KERNELS = ("triton", "mosaic")
MOSAIC_OPTIONS = ("block_t", "num_stages", "num_splits", "precision", "convert", "split_m")   # what the Mosaic kernel takes


def resolve_kernel(kernel, q, keys, interpret, triton_options=()):
    """kernel "auto" / None -> "triton" if `gpu_mosaic.AUTO` is False; with it True (the default since session 21),
    "mosaic" for decode over keys in `gpu_mosaic.AUTO_FORMATS` where the Mosaic kernel applies (compiled on a GPU,
    head_dim 128, T % 8 == 0, at most `gpu_mosaic.MAX_QUERIES` queries per row and at least `MIN_ROWS` query rows
    in all, or bf16 keys filling a wave of CTAs from fewer rows: `gpu_mosaic.auto_takes`; no tuning option given:
    those in `triton_options` keep the Triton kernel they were written for), else "triton". "mosaic" explicitly:
    `gpu_mosaic.indexer_scores_mosaic` says why where it does not apply."""
    from . import gpu_mosaic

    kernel = kernel or "auto"
    if kernel not in KERNELS + ("auto",):
        raise ValueError(f"kernel must be one of {KERNELS + ('auto',)}, got {kernel!r}")
    if kernel == "auto":
        use = (gpu_mosaic.AUTO and not interpret and not triton_options and kernel_platform() == "gpu"
               and gpu_mosaic.auto_takes(q, keys))
        return "mosaic" if use else "triton"
    return kernel


def indexer_scores_gpu(q, weights, keys, n_visible, *, interpret=False, precision=None, block_q=None,
                       block_t=None, num_warps=None, num_stages=None, waves=None, num_splits=None, fp4_scale=None,
                       heads_major=None, pad_to_block=False, group_max_k=None, fp4_decode=None, fp4_scale_at=None,
                       kernel=None, convert=None, split_m=None):
    """Scores [B, S, T] (or [B, S, roundup(T, block_t)] with -inf padding if pad_to_block) like
    `reference.indexer_scores`.

    group_max_k (k of a threshold top-k that will consume the scores): returns (scores, group_max) where
    group_max [B, S, n_split, G] int32 holds each program's maxima of the ordered keys of the threshold top-k's
    strided groups (G = `topk.threshold_groups(T_out, k)`), or None where that does not pay or fit: G == 0, G not
    a multiple of block_t, the partials not under half the row (n_split * G > T_out / 2, e.g. batch 1), more than
    4096 running maxima per program, or T_out (the returned row length) != the padded length.

    Grid (batch row, block of `block_q` queries, split of the key blocks); `num_splits` defaults to enough splits
    for `waves` x N_SM programs. heads_major: logits as q K^T [H, block_t] (the keys on the MMA's N side) instead
    of K q^T [block_t, H]; same values. fp4_decode ("alu", "asm"): how fp4 keys with precision="f16" become
    f16 operands, jnp integer ops or the packed inline PTX of `FP4_F16X2_ASM` (compiled GPU kernels only; bit-identical
    scores). Default: "asm" wherever it applies (compiled, fp4 / f16, block_t >= 8 x num_warps), else "alu"; on the
    H200 it cut the fp4 scores kernel 7-9% (B = 64: 221 -> 206 us at 128K, 1690 -> 1551 us at 1M; session 13).
    fp4_scale_at ("result", "operand"; the default `default_fp4_scale_at`: "operand" for fp4 keys with
    precision="f16", the only case it applies to): where the 32-channel groups' scales go: onto each group's
    [block_t, H] logits (a multiply and an add per logit and group), or onto the f16 key operands (one multiply per
    value, relative to the key's largest group scale, which multiplies the score after the head sum). On the H200,
    B = 64: scores 202.7 -> 170.4 us at 128K, 1550 -> 1277 us at 1M (session 14)."""
    given = dict(block_q=block_q, num_warps=num_warps, waves=waves, fp4_scale=fp4_scale, heads_major=heads_major,
                 fp4_decode=fp4_decode, fp4_scale_at=fp4_scale_at, precision=precision)
    if scores_kernel_of(q, keys, interpret, dict(given, block_t=block_t, num_stages=num_stages,
                                                 num_splits=num_splits, kernel=kernel)) == "mosaic":
        from .gpu_mosaic import indexer_scores_mosaic

        extra = [k_ for k_, v_ in given.items() if v_ is not None and k_ != "precision"]
        if extra:
            raise ValueError(f"kernel='mosaic' takes only {MOSAIC_OPTIONS}, got {extra}")
        return indexer_scores_mosaic(q, weights, keys, n_visible, block_t=block_t, num_stages=num_stages,
                                     num_splits=num_splits, pad_to_block=pad_to_block, precision=precision,
                                     convert=convert, group_max_k=group_max_k, split_m=split_m,
                                     interpret=interpret)
    if convert is not None or split_m is not None:
        raise ValueError("convert (how fp8 key codes become f16) and split_m are options of the Mosaic kernel "
                         "(kernel='mosaic' or 'auto' where it applies); the Triton kernel has neither")
    B, S, H, d = q.shape
    T = keys.shape[1]
    fmt = key_format_of(keys)
    precision = precision or DEFAULT_PRECISION[fmt]
    hp = max(16, H)
    if precision not in N_TERMS:
        raise ValueError(f"unknown precision {precision!r}; expected one of {tuple(N_TERMS)}")
    n_terms = N_TERMS[precision]
    if precision == "f16" and fmt not in ("fp8", "fp4"):
        raise ValueError("precision='f16' is for fp8 / fp4 keys (their codes convert to f16 exactly)")
    if precision == "fp8" and fmt not in ("fp8", "fp4"):
        raise ValueError("precision='fp8' is for fp8 / fp4 keys (fp8 tensor-core operands; q quantized like the keys)")
    if precision in ("f16", "fp8") and fmt == "fp4" and d % 32:
        raise ValueError(f"fp4 keys need index_head_dim % 32 == 0, got {d}")
    op_dtype = fp8_operand_dtype(fmt) if precision == "fp8" else OP_DTYPE[precision]
    key_bytes = {"bf16": 2, "fp8": 1, "fp4": 0.5}[fmt] if fmt else keys.dtype.itemsize
    cfg = default_config(S, T, q_bytes=hp * d * n_terms * jnp.dtype(op_dtype).itemsize, key_bytes=key_bytes)
    for k_, v_ in dict(block_q=block_q, block_t=block_t, num_warps=num_warps, num_stages=num_stages,
                       waves=waves, fp4_scale=fp4_scale, heads_major=heads_major, fp4_decode=fp4_decode,
                       fp4_scale_at=fp4_scale_at).items():
        if v_ is not None:
            cfg[k_] = v_
    if cfg["fp4_scale_at"] is None:
        cfg["fp4_scale_at"] = default_fp4_scale_at(fmt, precision)
    if cfg["fp4_decode"] is None:
        cfg["fp4_decode"] = default_fp4_decode(fmt, precision, cfg["block_t"], cfg["num_warps"], interpret)
    if cfg["fp4_scale_at"] not in FP4_SCALE_AT:
        raise ValueError(f"fp4_scale_at must be one of {FP4_SCALE_AT}, got {cfg['fp4_scale_at']!r}")
    if cfg["fp4_scale_at"] == "operand" and not (fmt == "fp4" and precision == "f16"):
        raise ValueError(f"fp4_scale_at='operand' applies to fp4 keys with precision='f16', got {fmt} / {precision}")
    if cfg["fp4_decode"] not in FP4_DECODES:
        raise ValueError(f"fp4_decode must be one of {FP4_DECODES}, got {cfg['fp4_decode']!r}")
    if cfg["fp4_decode"] == "asm":
        if interpret:
            raise ValueError("fp4_decode='asm' is inline PTX: compiled GPU kernels only (no interpret mode)")
        if not (fmt == "fp4" and precision == "f16"):
            raise ValueError(f"fp4_decode='asm' applies to fp4 keys with precision='f16', got {fmt} / {precision}")
        if cfg["block_t"] * 16 < 4 * 32 * cfg["num_warps"]:
            # each asm instance takes 4 bytes from one thread's registers: a [block_t, 16] byte tile must give
            # every thread at least 4 (the GPU tests ran 64-key blocks on 4 warps: 8 per thread)
            raise ValueError(f"fp4_decode='asm' needs block_t >= {8 * cfg['num_warps']} with {cfg['num_warps']} "
                             f"warps, got block_t={cfg['block_t']}")
    bq, bt = cfg["block_q"], cfg["block_t"]
    Sp = -(-S // bq) * bq
    nb = -(-T // bt)
    Tp = nb * bt
    n_split = num_splits or max(1, -(-cfg["waves"] * N_SM_H200 // (B * (Sp // bq))))
    bps = -(-nb // min(n_split, nb))
    n_split = -(-nb // bps)
    G = 0 if group_max_k is None else producer_groups(T, Tp, group_max_k, block=bt, n_split=n_split,
                                                      pad_to_block=pad_to_block, queries=bq)
    qf = q.astype(jnp.float32)
    wf = weights.astype(jnp.float32)
    if hp != H:  # tensor-core dots need >= 16 columns; padded heads have weight 0
        qf = jnp.pad(qf, ((0, 0), (0, 0), (0, hp - H), (0, 0)))
        wf = jnp.pad(wf, ((0, 0), (0, 0), (0, hp - H)))
    nv = n_visible.astype(jnp.int32)
    if Sp != S:
        qf = jnp.pad(qf, ((0, 0), (0, Sp - S), (0, 0), (0, 0)))
        wf = jnp.pad(wf, ((0, 0), (0, Sp - S), (0, 0)))
        nv = jnp.pad(nv, ((0, 0), (0, Sp - S)))
    if precision == "fp8":   # q as an fp8 operand, its per-(token, head) scale folded into the head weights
        qf, q_scale = quantize_q_fp8(qf, fmt)
        wf = wf * q_scale
    qparts, _ = split_q(qf, fmt, precision)
    kparts = (keys,) if not isinstance(keys, formats.QuantizedKeys) else (keys.values, keys.scale)
    grid = (B, Sp // bq, n_split)
    full = lambda shape: pl.BlockSpec(shape, lambda b, i, j: (0,) * len(shape))
    in_specs = [pl.BlockSpec((None, bq), lambda b, i, j: (b, i)), pl.BlockSpec((None, bq, hp), lambda b, i, j: (b, i, 0))]
    in_specs += [pl.BlockSpec((None, bq, hp, p.shape[-1]), lambda b, i, j: (b, i, 0, 0)) for p in qparts]
    in_specs += [full(p.shape) for p in kparts]
    kernel = functools.partial(_kernel, fmt=fmt, n_qparts=len(qparts), n_terms=n_terms, block_q=bq, block_t=bt,
                               T=T, d=d, precision=precision, op_dtype=op_dtype, blocks_per_split=bps,
                               n_blocks=nb, fp4_scale=cfg["fp4_scale"], heads_major=bool(cfg["heads_major"]),
                               gmax_groups=G, fp4_decode=cfg["fp4_decode"], fp4_scale_at=cfg["fp4_scale_at"])
    extra = {}
    if not interpret:
        extra["compiler_params"] = plgpu.CompilerParams(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    out_specs, out_shape = [full((B, Sp, Tp))], [jax.ShapeDtypeStruct((B, Sp, Tp), jnp.float32)]
    if G:
        out_specs.append(full((B, Sp, n_split, G)))
        out_shape.append(jax.ShapeDtypeStruct((B, Sp, n_split, G), jnp.int32))
    outs = pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape, interpret=interpret,
        name=f"indexer_scores_{fmt}_q{bq}_t{bt}" + (f"_g{G}" if G else ""), **extra,
    )(nv, wf, *qparts, *kparts)
    out = outs[0][:, :S]
    out = out if pad_to_block else out[..., :T]
    if group_max_k is None:
        return out
    return out, (outs[1][:, :S] if G else None)


TOPK_METHODS = ("lax", "blockwise", "radix", "radix4", "grouped", "grouped<N>", "threshold", "threshold_rank",
                "threshold_select", "threshold_set", "threshold_fused", "threshold_fused_set",
                "threshold_regions", "threshold_regions_set", "hist", "hist_set", "tour", "tour_set", "auto_set",
                "segment_set")
THRESHOLD_METHODS = {"threshold": "pallas_compact", "threshold_rank": "pallas", "threshold_select": "pallas_select",
                     "threshold_set": "pallas_select", "threshold_fused": "pallas_fused",
                     "threshold_fused_set": "pallas_fused",
                     "threshold_regions": "pallas_regions", "threshold_regions_set": "pallas_regions",
                     "hist": "pallas_hist", "hist_set": "pallas_hist", "tour": "pallas_tour", "tour_set": "pallas_tour"}
# method -> topk_threshold impl on a GPU ("xla" elsewhere)
SET_METHODS = ("threshold_set", "threshold_fused_set", "threshold_regions_set", "hist_set", "tour_set", "auto_set",
               "segment_set")
# the picks as an index set, not sorted

# "auto_set" (the model's GPU default for index-set picks): "hist_set" (one Triton program per row, histogram radix
# select) for rows of 2048-16384 candidates (8K-64K context), and for rows of up to 32768 (128K context) where a call
# has >= 96 rows; "tour_set" (the same kernel as a tournament over segments) for longer rows where a call holds at
# most 2^21 candidates and the tournament needs at most two segment stages (all k <= 512 up to 1M context; k = 1024
# up to 256K); "threshold_set" (the chain) elsewhere. H200 (topk_stages.py, us per call including ~8-12 us of
# harness, "prefix" = rows valid only in their first T / 10 entries, a cache filled to L < T):
# - session 34: T = 2048, 64 rows 13.7 vs 30.8 (lax.top_k, the chain's small-row shortcut), 1 row 10.9 vs 29.0
#   (pipelines at 8K context: B = 64 43.1 -> 25.0 us fp8, 44.1 -> 27.4 bf16; B = 1 34.2 -> 16.8 bf16); T = 4096, 64
#   rows 14.8 vs 30.5. T = 262144 (1M context): 1 row 219 vs 32, 64 rows 379 vs 162.
# - session 35 (results/h200_s35r{1,2,3}_topk.log), hist vs chain, full / prefix rows:
#   T = 8192: 1 row 16.6 / 16.8 vs 28.3 / 28.9; 64 rows 18.7 / 22.7 vs 33.7 / 37.6; 256 rows 32.8 / 36.2 vs 50.1 / 50.1
#   T = 16384: 1 row 22.1 / 22.8 vs 30.3 / 29.8; 64 rows 27.6 / 38.9 vs 38.5 / 44.0; 256 rows 48.1 / 54.0 vs 56.5 / 69.0
#   T = 32768: 8 rows 36.5 / 37.9 vs 30.2 / 30.2; 32 rows 43.3 / 47.6 vs 41.1 / 43.2; 64 rows 45.1 / 53.2 vs
#   46.2 / 48.2 (so the chain keeps <= 64 rows); 96 rows 51.7 / 48.4 vs 54.0 / 54.1; 128 rows 52.0 / 51.5 vs
#   59.1 / 65.7; 512 rows 174.0 / 207.6 vs 195.0 / 204.9
#   T = 65536: 64 rows 70.7 / 76.1 vs 64.4 / 68.0; 128 rows 81.6 / 112.9 vs 87.2 / 106.3 (mixed: the chain keeps it)
#   T = 262144, 128 rows: 425.9 / 491.0 vs 274.8 / 358.5.
# Rows shorter than 2048 keep the chain's shortcut (a plain lax.top_k): not timed there, and the one GPU run of the
# model test with the kernel on its tiny rows lost its pytest worker (cause not found; the kernel alone passes on rows
# of 8-1500, `test_gpu_hist_small_rows`, and the model test passes with this rule).
# - session 36 (results/h200_s36r{3,4}_idx.log): the tournament ("tour_set") on rows longer than 16384 where a call
#   holds at most 2^21 candidates (the whole GPU then works on few rows), whole fp8 / bf16 indexer calls, us, auto_set
#   of the time vs tour_set: B = 64 x 128K fp8 136.5 / 137.2 vs 125.5 / 126.5; B = 16 x 128K 75.5 / 74.8 vs 51.5 /
#   51.7; B = 1 x 128K bf16 38.3 / 34.6 vs 28.3 / 27.0; B = 1 x 256K bf16 44.7 vs 33.7; B = 1 x 1M fp8 52.0 / 47.0 vs
#   41.5 / 41.6; B = 4 x 1M bf16 120.7 vs 111.0; B = 8 x 1M fp8 143.0 vs 138.6; B = 32 x 256K fp8 146.9 vs 132.6.
#   Larger calls keep their methods: B = 128 x 128K fp8 (hist) 223.3 / 228.5 vs 230.6 / 229.1; B = 64 x 256K
#   (the chain) 74.0 vs 76.6 fp8 (T = 16384: hist), 64 x 1M rows in topk_stages 155.8 vs 217.9.
AUTO_SET_HIST_T = (2048, 16384)       # candidates per row: the kernel at any row count
AUTO_SET_HIST_WIDE = (32768, 96)      # up to this many candidates per row: the kernel from this many rows per call
AUTO_SET_TOUR_MAX = 1 << 21           # rows x candidates per call up to which longer rows take the tournament
AUTO_SET_TOUR_STAGES = 2              # ... when it needs at most this many segment stages before its final one
# (k = 1024, call 10, topk_stages with the harness: 8 x 262144, three stages, 67.1 vs the chain's 55.5 us; two
# stages: 64 x 32768 49.8 vs 51.1, 16 x 32768 25.8 vs 42.3, 1 x 65536 27.5 vs 35.3)


def resolve_set_method(T: int, k: int, rows: int = 1) -> str:
    """The set method "auto_set" runs for `rows` rows (per top-k call) of T candidates and k picks (see above)."""
    lo, hi = AUTO_SET_HIST_T
    t_wide, rows_wide = AUTO_SET_HIST_WIDE
    if min(k, T) >= T:                 # every candidate picked: the chain's shortcut returns them all
        return "threshold_set"
    if lo <= T <= hi or (hi < T <= t_wide and rows >= rows_wide):
        return "hist_set"
    if T > hi and rows * T <= AUTO_SET_TOUR_MAX:
        from .topk_hist import tournament_stages

        if tournament_stages(T, k) <= AUTO_SET_TOUR_STAGES:
            return "tour_set"
    return "threshold_set"


def radix_bits_of(topk: str, radix_bits: Optional[int] = None) -> Optional[int]:
    """Digit width of a radix top-k method ("radix" -> 8, "radix4" -> 4, "radixN" -> N; `radix_bits` overrides),
    None for the other methods; ValueError for an unknown method."""
    if (topk in ("lax", "blockwise", "auto_set", "segment_set") or topk in THRESHOLD_METHODS
            or topk.startswith("grouped")):
        if topk.startswith("grouped") and not (topk == "grouped" or topk[7:].isdigit()):
            raise ValueError(f"unknown topk method {topk!r}; expected one of {TOPK_METHODS}")
        return None
    if topk.startswith("radix") and (topk == "radix" or topk[5:].isdigit()):
        return int(radix_bits or (topk[5:] or 8))
    raise ValueError(f"unknown topk method {topk!r}; expected one of {TOPK_METHODS}")


def topk_from_scores(scores, k, *, topk="lax", topk_block=4096, radix_bits=None, group_max=None):
    """scores [..., Tp] (-inf = invalid) -> picks [..., k] int32 sorted by descending score, ties -> lower index,
    -1 where the score is not finite. topk: one of TOPK_METHODS (same results), except SET_METHODS: the same
    picks as an index set (`topk.as_index_set`: ascending index, the -1s last). group_max: the scores kernel's
    partial strided-group maxima for the threshold methods (`topk.topk_threshold`), else unused."""
    if topk == "auto_set":
        topk = resolve_set_method(scores.shape[-1], k, rows=math.prod(scores.shape[:-1]))
    bits = radix_bits_of(topk, radix_bits)
    if topk in THRESHOLD_METHODS:
        from .topk import topk_threshold

        impl = THRESHOLD_METHODS[topk] if kernel_platform() == "gpu" else "xla"
        return topk_threshold(scores, k, impl=impl, sorted=topk not in SET_METHODS, group_max=group_max)
    if topk.startswith("grouped"):
        from .topk import topk_grouped

        return topk_grouped(scores, k, group=int(topk[7:] or 32))
    if bits is not None:
        from .topk import topk_radix

        return topk_radix(scores, k, bits_per_pass=bits)
    if topk == "blockwise" and scores.shape[-1] > topk_block and topk_block > k:
        Tp = scores.shape[-1]
        nb = -(-Tp // topk_block)
        pad = nb * topk_block - Tp
        s = jnp.pad(scores, [(0, 0)] * (scores.ndim - 1) + [(0, pad)], constant_values=-jnp.inf)
        s = s.reshape(scores.shape[:-1] + (nb, topk_block))
        v1, i1 = jax.lax.top_k(s, k)                                   # [..., nb, k]
        i1 = i1 + (jnp.arange(nb, dtype=jnp.int32) * topk_block)[:, None]
        v1 = v1.reshape(scores.shape[:-1] + (nb * k,))
        i1 = i1.reshape(scores.shape[:-1] + (nb * k,))
        vals, pos = jax.lax.top_k(v1, k)
        idx = jnp.take_along_axis(i1, pos, axis=-1)
    else:
        vals, idx = jax.lax.top_k(scores, k)
    return jnp.where(jnp.isfinite(vals), idx, -1).astype(jnp.int32)


def topk_over_query_chunks(scores_fn, q, weights, keys, n_visible, *, k: int, query_chunk: int, topk: str,
                           topk_block: int, radix_bits: Optional[int] = None):
    """`reference.indexer_topk` with the scores from `scores_fn(q, w, keys, n_visible)` (a kernel), in query chunks."""
    k = min(k, keys.shape[1])
    radix_bits_of(topk, radix_bits)  # validate before tracing

    def select(args):
        qc, wc, nc = args
        out = scores_fn(qc, wc, keys, nc)   # scores, or (scores, partial group maxima or None)
        scores, gmax = out if isinstance(out, tuple) else (out, None)
        return topk_from_scores(scores, k, topk=topk, topk_block=topk_block, radix_bits=radix_bits,
                                group_max=gmax)

    return map_query_chunks(select, (q, weights, n_visible), query_chunk)


# kernel "auto" with any of these given keeps the Triton kernel (whose knobs they are); Mosaic is tuned with
# kernel="mosaic"
TUNING_OPTIONS = ("block_q", "block_t", "num_warps", "num_stages", "waves", "num_splits", "fp4_scale", "heads_major",
                  "fp4_decode", "fp4_scale_at", "precision")


def scores_kernel_of(q, keys, interpret, kernel_options) -> str:
    """The scores kernel ("mosaic" / "triton") `indexer_scores_gpu` runs for these `kernel_options`."""
    tuned = tuple(k_ for k_ in TUNING_OPTIONS if kernel_options.get(k_) is not None)
    return resolve_kernel(kernel_options.get("kernel"), q, keys, interpret, tuned)


def takes_raw_q(q, keys, interpret, kernel_options) -> bool:
    """Whether these `kernel_options` run the scores on the Mosaic kernel over keys it quantizes q for itself
    (`gpu_mosaic.quantizes_q`), so the caller need not fake-quantize q first (`indexer_topk(quantize_q=True)`)."""
    from .gpu_mosaic import quantizes_q

    return (quantizes_q(keys, kernel_options.get("precision"))
            and scores_kernel_of(q, keys, interpret, kernel_options) == "mosaic")


def indexer_topk_gpu(q, weights, keys, n_visible, *, k: int, query_chunk: int = 256, interpret=False,
                     topk: str = "threshold", topk_block: int = 4096, radix_bits: Optional[int] = None,
                     fuse_group_max: Optional[bool] = None, **kernel_options):
    """Pallas GPU implementation of `reference.indexer_topk` (same arguments and results). fuse_group_max: with a
    threshold top-k, the scores kernel also writes the strided-group maxima the top-k bounds with (where that fits:
    `indexer_scores_gpu(group_max_k=...)`) instead of an XLA pass over the scores. Default (None): on where the
    scores run on the Mosaic kernel, off on Triton. On the H200 the Triton kernel saved nothing with it
    (B = 64, 128K context, bf16 keys: topk="threshold" 218.3 vs 218.7 us, "threshold_set" 215.5 vs 210.3:
    results/h200_s7r6_idx_fused_gmax.log). The Mosaic kernel's maxima (session 30) drop the XLA pass (6.8 us at
    B = 64 x 128K) for ~3 us more in the kernel; with its split_m default the fp8 / bf16 `threshold_set` pipelines
    took 2-6 us less (results/h200_s30r4_idx.log, h200_s30r6_idx.log); the default since session 31."""
    if topk == "auto_set":   # resolved here, so the scores kernel writes group maxima only for the chain
        topk = auto_set_method(q, keys, k, interpret, kernel_options, query_chunk)
    if topk == "segment_set":
        return segment_topk(q, weights, keys, n_visible, k=k, query_chunk=query_chunk, interpret=interpret,
                            **kernel_options)
    if fuse_group_max is None:
        fuse_group_max = scores_kernel_of(q, keys, interpret, kernel_options) == "mosaic"
    # the threshold methods bound with the group maxima; the histogram top-k ("hist*", "tour*") needs none
    fused = fuse_group_max and THRESHOLD_METHODS.get(topk) not in (None, "pallas_hist", "pallas_tour")
    scores = functools.partial(indexer_scores_gpu, interpret=interpret, pad_to_block=True,
                               group_max_k=min(k, keys.shape[1]) if fused else None, **kernel_options)
    return topk_over_query_chunks(scores, q, weights, keys, n_visible, k=k, query_chunk=query_chunk, topk=topk,
                                  topk_block=topk_block, radix_bits=radix_bits)


# "auto_set" takes "segment_set" for these key formats and rows of AUTO_SEGMENT_T candidates where the scores run on
# the Mosaic kernel, for calls of up to AUTO_SEGMENT_ROWS rows, whatever `resolve_set_method` gave:
# - instead of the tournament (<= 64 rows at 128K context; H200, session 40, results/h200_s40r{1,2}_idx.log, whole
#   calls in us, tour_set vs segment_set: B = 64 x 128K fp8 125.0 vs 122.5, B = 16 x 128K fp8 52.8 vs 51.2,
#   B = 64 x 128K fp4 134.5 vs 128.3; bf16 keys slower, 180.4 vs 186.6);
# - instead of the chain (65-95 rows) and the histogram kernel (96-128 rows) since session 57 (H100, 128K context,
#   own us, default then vs segment_set with `gpu_mosaic.select_splits`' split count: B = 80 fp4 134.2 vs 113.6 (6
#   splits), fp8 164.3 vs 141.5; B = 100 fp4 170.8 vs 132.4 (5), fp8 200.0 vs 168.5; B = 128 fp4 182.7 vs 166.8 (4),
#   fp8 239.9 vs 210.3; results/h100_s57r{8..11}_idx.log);
# - at 256K and 1M context (65536 / 262144 candidates a row) and up to 256 rows, session 58 (H100, own us, the
#   default then vs segment_set, in one call, results/h100_s58r1_idx2.log): B = 16 x 256K fp4 53.9 vs 48.4, fp8
#   68.7 vs 60.5; B = 64 x 256K fp8 254.0 vs 213.7 (fp4 190.0 vs 163.1 in session 57); B = 16 x 1M fp4 199.3 vs
#   169.1; B = 64 x 1M fp4 659.4 vs 609.2, fp8 906.2 vs 824.6; 128K context, B = 192 fp4 351.0 vs 247.4, fp8 406.6
#   vs 317.4, B = 256 fp4 352.0 vs 321.1; the same call with this rule as the default against gpu.AUTO_SEGMENT=0
#   (results/h100_s58r2_idxa.log): B = 32 x 256K fp4 99.7 -> 88.2, B = 128 x 256K fp4 353.5 -> 316.8, fp8 470.7 ->
#   419.8, B = 256 x 128K fp8 483.8 -> 419.1, B = 32 x 1M fp8 470.6 -> 408.2;
# - from 16384 candidates (64K context) and up to 512 rows, also session 58 (results/h100_s58r{2,3}_idx{b,c}.log,
#   the default then vs segment_set): B = 64 x 64K fp4 52.4 vs 48.7, fp8 68.7 vs 60.6, B = 256 x 64K fp8 243.1 vs
#   222.6, B = 16 x 64K fp8 23.6 vs 22.9, B = 128 x 64K fp4 88.4 vs 87.6; B = 384 x 128K fp4 523.7 vs 478.6, fp8
#   830.2 vs 623.4; B = 512 x 128K fp4 694.1 vs 640.1, fp8 937.0 vs 834.1. Not at 8192 candidates (32K context,
#   B = 64: fp8 38.9 vs 38.0, fp4 28.1 vs 28.9; 8K context fp8 9.4 vs 12.5), where the histogram kernel stays;
# - from 8193 candidates (past 32K context) and up to 1024 rows since session 59 (H100, own us, the histogram
#   top-k / the chain vs segment_set, results/h100_s59r1_idx.log): B = 64 x 40K fp8 42.1 vs 40.7, 48K fp4 33.9 vs
#   32.2, fp8 51.5 vs 46.6, 60K fp8 59.8 vs 52.0, B = 128 x 48K fp8 94.9 vs 86.2; B = 640 x 128K fp8 1315.6 vs
#   1028.9, B = 768 x 128K fp4 1005.8 vs 952.5, B = 1024 x 128K fp8 1856.7 vs 1673.7, B = 1024 x 64K fp4 701.4 vs
#   676.1; the rule as the default against gpu.AUTO_SEGMENT=0 in one call (results/h100_s59r3_idx.log): B = 64 x
#   48K fp8 50.3 -> 45.0, B = 32 x 60K fp4 27.6 -> 27.0, B = 640 x 128K fp4 868.9 -> 799.7.
# Past 1024 rows (H100, session 61, own us, the default vs this cap at 4096, results/h100_s61r2_idx.log): B = 1280 x
# 128K fp8 2265.0 vs 1993.2, B = 2048 x 64K fp4 1365.9 vs 1323.0; prefill 8 x 256 queries at 128K fp8 4141.5 vs
# 4172.0 is noise (prefill chunks score on the Triton kernel, which this rule leaves alone). The cap is 2048 since
# session 62, when `test_gpu_segment_set_past_1024_rows` (keys over 4 GiB) passed on an H100
# (results/h100_s62r1_tests5.log); the same session, this cap against 1024 in one call (results/h100_s62r3_idx.log):
# B = 1280 x 128K fp8 2325.2 -> 2039.9, B = 1536 x 128K fp4 1999.9 -> 1809.6. Past 2048 rows and past 262144
# candidates: not timed, the methods stay. Below MIN_ROWS rows (B = 1 decode) the scores run on the Triton kernel,
# which has no in-kernel selection, so the rule does not apply there.
AUTO_SEGMENT = True
AUTO_SEGMENT_FORMATS = ("fp8", "fp4")
AUTO_SEGMENT_T = (8193, 262144)
AUTO_SEGMENT_ROWS = 2048


def auto_set_method(q, keys, k: int, interpret, kernel_options, query_chunk: int = 256) -> str:
    """The set method topk="auto_set" runs for this call: `resolve_set_method`'s, or "segment_set" where
    `segment_auto_takes` (and the call has at most AUTO_SEGMENT_ROWS rows per top-k call)."""
    rows = q.shape[0] * min(q.shape[1], query_chunk)
    if rows <= AUTO_SEGMENT_ROWS and k < keys.shape[1] and segment_auto_takes(q, keys, interpret, kernel_options):
        return "segment_set"
    return resolve_set_method(keys.shape[1], k, rows=rows)


def segment_auto_takes(q, keys, interpret, kernel_options) -> bool:
    """Whether "auto_set" runs "segment_set" for these keys and options (see AUTO_SEGMENT)."""
    from .gpu_mosaic import key_format

    lo, hi = AUTO_SEGMENT_T
    T = keys.shape[1]   # QuantizedKeys.shape is the logical [B, T, d]
    return (AUTO_SEGMENT and not interpret and key_format(keys) in AUTO_SEGMENT_FORMATS and lo <= T <= hi
            and scores_kernel_of(q, keys, interpret, kernel_options) == "mosaic")


def select_from_survivors(keys, pos, k: int, interpret: bool = False):
    """keys / pos int32 [R, W]: segments' top-k supersets side by side (ordered keys, positions in the row, ascending
    position, padding (INT32_MIN, 0)) -> the row's top-k index set [R, k] (ascending, -1 padding for non-finite
    picks): tournament stages over the survivors while a row holds more than TOUR_CONFIG's final_max of them, then
    one program per row (`topk_hist.hist_select` with the position map)."""
    from .topk_hist import TOUR_CONFIG, _stage_runs, _tour_settings, hist_select, tournament_stage

    seg_len, final_max, slack = _tour_settings()
    while _stage_runs(keys.shape[1], k, seg_len, final_max, slack):
        keys, pos = tournament_stage(keys, k, pos, interpret=interpret)
    return hist_select(keys, k, finite_only=True, set_out=True, posmap=pos, num_warps=TOUR_CONFIG["final_warps"],
                       interpret=interpret)


def segment_topk(q, weights, keys, n_visible, *, k: int, query_chunk: int = 256, interpret=False, kernel=None,
                 select_slack: Optional[int] = None, **kernel_options):
    """topk="segment_set": the Mosaic scores kernel selects every split's top-k superset itself
    (`gpu_mosaic.indexer_scores_mosaic(select_k=k)`, `mosaic_select`) and writes only those, then
    `select_from_survivors` picks each row's set among the survivors. Same index set as the other set methods
    (`reference.indexer_topk`'s picks, ascending, -1s last). Compiled Mosaic kernels only (fp8, fp4 or bf16 keys,
    head_dim 128, T % 8 == 0)."""
    from .gpu_mosaic import indexer_scores_mosaic, mosaic_applies

    if interpret:
        raise ValueError("topk='segment_set' needs the compiled Mosaic GPU kernel (its selection is inline PTX); "
                         "interpret mode has none")
    if kernel not in (None, "auto", "mosaic"):
        raise ValueError(f"topk='segment_set' runs on the Mosaic scores kernel, got kernel={kernel!r}")
    if not mosaic_applies(q, keys):
        raise ValueError("topk='segment_set' needs what the Mosaic scores kernel takes: fp8 / fp4 / bf16 keys, "
                         f"head_dim 128, T % 8 == 0, <= 256 heads (got q {q.shape}, keys "
                         f"{getattr(keys, 'fmt', getattr(keys, 'dtype', type(keys).__name__))})")
    unknown = sorted(set(kernel_options) - set(MOSAIC_OPTIONS))
    if unknown:
        raise ValueError(f"topk='segment_set': options {unknown} do not apply to the Mosaic scores kernel")
    T = keys.shape[1]   # QuantizedKeys.shape is the logical [B, T, d]
    k = min(k, T)

    def select(args):
        qc, wc, nc = args
        res = indexer_scores_mosaic(qc, wc, keys, nc, select_k=k, select_slack=select_slack, **kernel_options)
        if not isinstance(res, tuple):   # the kernel's clusters selected each row's set
            return res
        sk, sp = res
        lead = sk.shape[:2]
        picks = select_from_survivors(sk.reshape(-1, sk.shape[-1]), sp.reshape(-1, sp.shape[-1]), k)
        return picks.reshape(lead + (k,))

    return map_query_chunks(select, (q, weights, n_visible), query_chunk)
