"""TPU Pallas (Mosaic) lightning-indexer scores kernel + top-k; the contract is `reference.indexer_topk`.

Grid (batch row b, block of `block_q` queries, block of `block_t` keys); all tiles through BlockSpecs (VMEM,
double-buffered by Pallas). Key blocks past the last one a query block sees (n_visible, scalar-prefetched as the
last visible block per query block) keep that block's index in the key BlockSpecs, so the pipeline copies nothing
for them and the step writes -inf without computing: a decode cache filled to L of its capacity reads ~L keys.
Per step: logits = (block_q * H) x dI queries against block_t keys on the MXU (f32 accumulation), ReLU, reshape
to [block_q, H, block_t], head-weighted sum, per-key fp8 scale, causal mask. Keys are dequantized in VMEM: bf16 /
f32 rows; fp8 e4m3 rows (scale applied to the result; the scale is passed transposed, [B, 1, T], so it broadcasts
over the lane axis); fp4 nibbles decoded arithmetically with the ue8m0 scales, dotted against the even / odd
channels of q. At fp4's default precision ("bf16") the kernel takes q as it comes (raw or already fake-quantized:
the quantization is idempotent) and prepares it itself once a query block, at its first key step
(`_prepare_fp4_q`): the fp4 fake quantization by masked lane maxima and bit arithmetic, the even / odd channels by
two 0/1 matmuls on the MXU, into VMEM scratch. Done in XLA (`formats.fake_quantize`'s nibble packing and
unpacking, then `split_q`'s strided slices) the same steps re-tiled q's minor dimension again and again: 0.45 GB of
relayout copies for a V4-Flash CSA layer's indexer over an 8 x 512-query prefill chunk (session 53, libtpu compile
for v6e: 1088 -> 635 MB; `benchmarks/results/README_tpu.md`).

Status: validated in the TPU interpreter (`pltpu.InterpretParams`) on CPU, and Pallas' Mosaic lowering for a TPU
(v6e) target runs in CI (`tests/test_tpu_lowering.py`); libtpu compiles it for v6e / v5e topologies on a CPU host
(`benchmarks/tpu_offline.py`, session 50); never run on a TPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import formats
from .gpu import e2m1_value, key_format_of, split_q, topk_over_query_chunks
from .q_prep import fake_quantize_fp4_rows


def _prepare_fp4_q(q):
    """In the kernel: q [rows, dI] f32, raw or fake-quantized -> (its even, its odd channels) bf16 [rows, dI / 2],
    fake-quantized to fp4 first: `formats.fake_quantize(q, "fp4")` exactly, by `q_prep.fake_quantize_fp4_rows`
    (each 32-channel group's exponent from a masked lane maximum, no [.., dI/32, 32] reshape; e2m1 rounding by
    integer ops on the bits).
    The values (an e2m1 code times a power of two) are exact in bf16; the even / odd channels come out of two 0/1
    matmuls, exact too (one nonzero product a column, f32 accumulation). Fake quantization is idempotent, so an
    already quantized q comes out unchanged. (A value whose code rounds past f32's range, |q| > ~3.2e38, is inf in
    the reference's quantization; here the matmuls spread it as NaN over its row: no finite score either way.)"""
    d = q.shape[1]
    fq = fake_quantize_fp4_rows(q).astype(jnp.bfloat16)
    chan = jax.lax.broadcasted_iota(jnp.int32, (d, d // 2), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (d, d // 2), 1)
    take = lambda parity: jnp.dot(fq, jnp.where(chan == 2 * col + parity, 1.0, 0.0).astype(jnp.bfloat16),
                                  preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    return take(0), take(1)


def takes_raw_q(keys, kernel_options) -> bool:
    """Whether the TPU kernel fake-quantizes q itself for these keys and options (fp4 keys at precision "bf16",
    `_prepare_fp4_q`), so `indexer_topk(quantize_q=True)` need not do it in XLA first."""
    fmt = key_format_of(keys)
    return fmt == "fp4" and (kernel_options.get("precision") or DEFAULT_PRECISION[fmt]) == "bf16"


def _kernel(last_ref, nvis_ref, w_ref, *refs, fmt, n_qparts, n_terms, block_q, block_t, H, T, op_dtype, n_qb,
            q_in_kernel=False):
    if q_in_kernel:   # refs: q, keys..., out, then the scratch for q's even / odd channels
        q_ref, *refs, even_ref, odd_ref = refs

        @pl.when(pl.program_id(2) == 0)   # a query block's first key step (the key axis runs in order)
        def _():
            even_ref[...], odd_ref[...] = _prepare_fp4_q(q_ref[...].astype(jnp.float32))

        refs = [even_ref, odd_ref] + refs
    o_ref = refs[-1]
    j = pl.program_id(2)
    last = last_ref[pl.program_id(0) * n_qb + pl.program_id(1)]

    @pl.when(j <= last)
    def _():
        _scores(nvis_ref, w_ref, *refs, fmt=fmt, n_qparts=n_qparts, n_terms=n_terms, block_q=block_q,
                block_t=block_t, H=H, T=T, op_dtype=op_dtype)

    @pl.when(j > last)   # no query of this block sees these keys (their copy was skipped: the block index repeats)
    def _():
        o_ref[...] = jnp.full(o_ref.shape, -jnp.inf, o_ref.dtype)


def _scores(nvis_ref, w_ref, *refs, fmt, n_qparts, n_terms, block_q, block_t, H, T, op_dtype):
    q_refs = refs[:n_qparts]
    key_refs = refs[n_qparts:-1]
    o_ref = refs[-1]
    j = pl.program_id(2)
    cols = j * block_t + jax.lax.broadcasted_iota(jnp.int32, (block_q, block_t), 1)
    dims = (((1,), (1,)), ((), ()))
    # f32 operands: HIGHEST (full f32 products); bf16 operands multiply exactly into f32 at the default, and
    # Mosaic's compiler rejects an fp32 contract precision on bf16 operands ("Bad lhs type", libtpu, session 50)
    dot = lambda a, b: jax.lax.dot_general(
        a, b, dims, preferred_element_type=jnp.float32,
        precision=jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else jax.lax.Precision.DEFAULT)
    if fmt in (None, "bf16", "fp8"):
        k = key_refs[0][...].astype(jnp.float32).astype(op_dtype)
        kparts = [(k, 0)]
    else:
        raw = key_refs[0][...].astype(jnp.int32)                       # [bt, dI/2]
        sb = key_refs[1][...].astype(jnp.int32)                        # [bt, dI/32]
        sc = jnp.where(sb == 0, 2.0 ** -127, jax.lax.bitcast_convert_type(jnp.maximum(sb, 1) << 23, jnp.float32))
        grp = jax.lax.broadcasted_iota(jnp.int32, raw.shape, 1) // 16
        scale = jnp.zeros(raw.shape, jnp.float32)
        for g in range(sb.shape[1]):
            scale = jnp.where(grp == g, sc[:, g:g + 1], scale)
        kparts = [((e2m1_value(raw & 0xF) * scale).astype(op_dtype), 0),
                  ((e2m1_value(raw >> 4) * scale).astype(op_dtype), 1)]
    logits = None
    per = 2 if fmt == "fp4" else 1
    for term in range(n_terms):
        for kop, part in kparts:
            t = dot(q_refs[term * per + part][...], kop)                # [bq*H, bt]
            logits = t if logits is None else logits + t
    r = jnp.maximum(logits, 0.0).reshape(block_q, H, block_t)
    s = jnp.sum(r * w_ref[...].astype(jnp.float32)[:, :, None], axis=1)  # [bq, bt]
    if fmt == "fp8":
        s = s * key_refs[1][...]                                         # [1, bt]
    vis = (cols < nvis_ref[...]) & (cols < T)
    o_ref[...] = jnp.where(vis, s, -jnp.inf)


DEFAULT_PRECISION = {None: "f32", "bf16": "bf16x2", "fp8": "bf16", "fp4": "bf16"}  # no f16 operands on the MXU path


def indexer_scores_tpu(q, weights, keys, n_visible, *, interpret=False, precision=None, block_q=8, block_t=None,
                       pad_to_block=False):
    B, S, H, d = q.shape
    T = keys.shape[1]
    fmt = key_format_of(keys)
    precision = precision or DEFAULT_PRECISION[fmt]
    # fewer queries than a block (decode: 1, MTP: 2): one block of exactly those, no padded query rows to read and
    # score (a block dim equal to the array's is a legal tile)
    bq = block_q if S >= block_q else S
    bt = block_t or (512 if T >= 512 else 128)
    Sp = -(-S // bq) * bq
    Tp = -(-T // bt) * bt
    qf, wf, nv = q.astype(jnp.float32), weights.astype(jnp.float32), n_visible.astype(jnp.int32)
    if Sp != S:
        qf = jnp.pad(qf, ((0, 0), (0, Sp - S), (0, 0), (0, 0)))
        wf = jnp.pad(wf, ((0, 0), (0, Sp - S), (0, 0)))
        nv = jnp.pad(nv, ((0, 0), (0, Sp - S)))
    q_in_kernel = takes_raw_q(keys, dict(precision=precision))
    if q_in_kernel:   # q whole ([B, Sp * H, dI] merges major dims only: no relayout); the kernel splits it
        qparts, n_terms = [qf.reshape(B, Sp * H, d)], 1
    else:
        qparts, n_terms = split_q(qf, fmt, precision)
        qparts = [p.reshape(B, Sp * H, p.shape[-1]) for p in qparts]
    op_dtype = jnp.float32 if precision == "f32" else jnp.bfloat16
    # the last key block any query of a query block sees: later steps of that block repeat its index in the key
    # BlockSpecs, so the pipeline copies nothing for them (a decode cache filled to L reads ~L keys, not its
    # capacity), and the kernel writes -inf there without computing
    n_qb = Sp // bq
    seen = jnp.max(jnp.clip(nv, 0, T).reshape(B, n_qb, bq), axis=-1)
    last = (jnp.maximum(seen, 1) - 1) // bt
    last = jnp.where(seen > 0, last, -1).reshape(B * n_qb).astype(jnp.int32)   # -1: the block sees no key
    at = lambda b, i, j, last_ref: jnp.minimum(j, jnp.maximum(last_ref[b * n_qb + i], 0))
    if fmt in (None, "bf16"):
        kparts = [keys]
        kspecs = [pl.BlockSpec((None, bt, d), lambda b, i, j, lr: (b, at(b, i, j, lr), 0))]
    elif fmt == "fp8":
        kparts = [keys.values, jnp.swapaxes(keys.scale, 1, 2)]          # scale -> [B, 1, T]
        kspecs = [pl.BlockSpec((None, bt, d), lambda b, i, j, lr: (b, at(b, i, j, lr), 0)),
                  pl.BlockSpec((None, 1, bt), lambda b, i, j, lr: (b, 0, at(b, i, j, lr)))]
    else:
        kparts = [keys.values, keys.scale]
        kspecs = [pl.BlockSpec((None, bt, d // 2), lambda b, i, j, lr: (b, at(b, i, j, lr), 0)),
                  pl.BlockSpec((None, bt, d // formats.FP4_BLOCK), lambda b, i, j, lr: (b, at(b, i, j, lr), 0))]
    in_specs = [pl.BlockSpec((None, bq, 1), lambda b, i, j, lr: (b, i, 0)),
                pl.BlockSpec((None, bq, H), lambda b, i, j, lr: (b, i, 0))]
    in_specs += [pl.BlockSpec((None, bq * H, p.shape[-1]), lambda b, i, j, lr: (b, i, 0)) for p in qparts]
    in_specs += kspecs
    kernel = functools.partial(_kernel, fmt=fmt, n_qparts=2 if q_in_kernel else len(qparts), n_terms=n_terms,
                               block_q=bq, block_t=bt, H=H, T=T, op_dtype=op_dtype, n_qb=n_qb,
                               q_in_kernel=q_in_kernel)
    extra = dict(interpret=pltpu.InterpretParams()) if interpret else {}
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=(B, n_qb, Tp // bt), in_specs=in_specs,
        out_specs=pl.BlockSpec((None, bq, bt), lambda b, i, j, lr: (b, i, j)),
        scratch_shapes=[pltpu.VMEM((bq * H, d // 2), jnp.bfloat16)] * 2 if q_in_kernel else [])
    out = pl.pallas_call(
        kernel, grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((B, Sp, Tp), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        name=f"indexer_scores_tpu_{fmt}", **extra,
    )(last, nv[..., None], wf, *qparts, *kparts)
    out = out[:, :S]
    return out if pad_to_block else out[..., :T]


def indexer_topk_tpu(q, weights, keys, n_visible, *, k: int, query_chunk: int = 256, interpret=False,
                     topk: str = "lax", topk_block: int = 4096, radix_bits=None, **kernel_options):
    """Mosaic TPU implementation of `reference.indexer_topk` (same arguments and results)."""
    scores = functools.partial(indexer_scores_tpu, interpret=interpret, pad_to_block=True, **kernel_options)
    return topk_over_query_chunks(scores, q, weights, keys, n_visible, k=k, query_chunk=query_chunk, topk=topk,
                                  topk_block=topk_block, radix_bits=radix_bits)
