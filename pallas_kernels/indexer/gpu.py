"""GPU Pallas (Triton backend) lightning-indexer scores kernel + top-k; the contract is `reference.indexer_topk`.

Scores kernel: one program = (batch row b, block of `block_q` queries, block of `block_t` keys). It loads the key
block once (dequantizing in registers: bf16 / f32 rows; fp8 e4m3 rows whose per-key power-of-two scale is applied
to the [block_t] result since ReLU(s x) = s ReLU(x) for s > 0; fp4 packed e2m1 nibbles decoded arithmetically,
times the ue8m0 block scale), then for each query of the block computes logits = K q^T [block_t, H] on the tensor
cores, ReLU, the head-weighted sum and the causal mask (t < n_visible, -inf otherwise), and writes one score row.
Keys past the last visible entry of the query block are not read (masked loads).

fp4 de-interleave: byte j holds elements 2j (low nibble) and 2j+1 (high nibble); instead of interleaving the
decoded nibbles the kernel splits q into its even and odd channels outside (tiny) and does two dots per 16-byte
group (one ue8m0 scale per 16 bytes = 32 elements).

Precision ("precision" option): "bf16" (bf16 operands, f32 accumulate; exact products for fp8 / fp4 keys with
fake-quantized queries, which are bf16-representable), "bf16x2" (q split into bf16 hi + lo: ~16-bit mantissa, for
bf16 keys and float queries), "f32" (fp32 FMA dot, no tf32). Defaults: None -> "f32", bf16 -> "bf16x2",
fp8 / fp4 -> "bf16".

Top-k ("topk" option): "lax" = `lax.top_k` over each query's [T] scores (XLA), "blockwise" = `lax.top_k` per
`topk_block` candidates then over the concatenated survivors (ties still go to the lower index). Scores are
materialized per query chunk only ([B, query_chunk, T] f32), so prefill memory stays bounded.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

try:
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover
    plgpu = None

from . import formats
from ..chunking import map_query_chunks

N_SM_H200 = 132
DEFAULT_PRECISION = {None: "f32", "bf16": "bf16x2", "fp8": "bf16", "fp4": "bf16"}


def key_format_of(keys) -> Optional[str]:
    if isinstance(keys, formats.QuantizedKeys):
        return keys.fmt
    return "bf16" if keys.dtype == jnp.bfloat16 else None


def split_q(q, fmt, precision):
    """q [..., H, dI] float32 -> list of operand arrays (bf16 / f32), fp4: even/odd channels interleave undone."""
    if fmt == "fp4":
        parts = [q[..., 0::2], q[..., 1::2]]
    else:
        parts = [q]
    if precision == "f32":
        return [p.astype(jnp.float32) for p in parts], 1
    hi = [p.astype(jnp.bfloat16) for p in parts]
    if precision == "bf16":
        return hi, 1
    lo = [(p - h.astype(jnp.float32)).astype(jnp.bfloat16) for p, h in zip(parts, hi)]
    return hi + lo, 2


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


def _kernel(nvis_ref, w_ref, *refs, fmt, n_qparts, n_terms, block_q, block_t, T, d, precision, op_dtype):
    q_refs = refs[:n_qparts]
    rest = refs[n_qparts:]
    o_ref = rest[-1]
    key_refs = rest[:-1]
    b = pl.program_id(0)
    j = pl.program_id(2)
    nvis = nvis_ref[...]                                   # [block_q] int32
    rows = j * block_t + jax.lax.iota(jnp.int32, block_t)
    lim = jnp.minimum(jnp.max(nvis), T)
    live = rows < lim
    live2 = live[:, None]

    # key block -> list of (operand [block_t, w], which q part, column offset, optional per-row scale)
    if fmt in (None, "bf16"):
        cols = jax.lax.broadcasted_iota(jnp.int32, (1, d), 1)
        k = plgpu.load(key_refs[0].at[b, rows[:, None], cols], mask=live2, other=0.0)
        kparts = [(k.astype(op_dtype), 0, 0, d)]
        row_scale = None
    elif fmt == "fp8":
        cols = jax.lax.broadcasted_iota(jnp.int32, (1, d), 1)
        k = plgpu.load(key_refs[0].at[b, rows[:, None], cols], mask=live2)   # masked rows end up -inf anyway
        kparts = [(k.astype(jnp.float32).astype(op_dtype), 0, 0, d)]
        row_scale = plgpu.load(key_refs[1].at[b, rows, jnp.zeros_like(rows)], mask=live, other=0.0)
    else:  # fp4: 16-byte groups, one ue8m0 scale each
        kparts = []
        row_scale = None
        g16 = jax.lax.broadcasted_iota(jnp.int32, (1, 16), 1)
        for g in range(d // 32):
            raw = plgpu.load(key_refs[0].at[b, rows[:, None], g * 16 + g16], mask=live2, other=0).astype(jnp.int32)
            sb = plgpu.load(key_refs[1].at[b, rows, jnp.full_like(rows, g)], mask=live, other=127).astype(jnp.int32)
            sc = jax.lax.bitcast_convert_type(jnp.maximum(sb, 1) << 23, jnp.float32)
            sc = jnp.where(sb == 0, 2.0 ** -127, sc)[:, None]
            lo = (e2m1_value(raw & 0xF) * sc).astype(op_dtype)
            hi = (e2m1_value(raw >> 4) * sc).astype(op_dtype)
            kparts.append((lo, 0, g * 16, 16))
            kparts.append((hi, 1, g * 16, 16))

    for qq in range(block_q):
        w = w_ref[qq, :].astype(jnp.float32)               # [H]
        logits = None
        for term in range(n_terms):
            for kop, part, c0, width in kparts:
                qv = q_refs[term * (2 if fmt == "fp4" else 1) + part][qq, :, pl.ds(c0, width)]
                t = _dot_nt(kop, qv, precision)
                logits = t if logits is None else logits + t
        s = jnp.sum(jnp.maximum(logits, 0.0) * w[None, :], axis=1)
        if row_scale is not None:
            s = s * row_scale
        vis = (rows < nvis_ref[qq]) & (rows < T)
        o_ref[qq, :] = jnp.where(vis, s, -jnp.inf)


def default_config(B, S, T, H, fmt):
    block_q = 1 if S == 1 else 8
    block_t = 128 if T >= 128 * 4 * N_SM_H200 // max(1, B) else 64
    block_t = min(block_t, max(16, 1 << (max(T, 1) - 1).bit_length()))
    return dict(block_q=block_q, block_t=max(16, block_t), num_warps=4, num_stages=2)


def indexer_scores_gpu(q, weights, keys, n_visible, *, interpret=False, precision=None, block_q=None,
                       block_t=None, num_warps=None, num_stages=None, pad_to_block=False):
    """Scores [B, S, T] (or [B, S, roundup(T, block_t)] with -inf padding if pad_to_block) like
    `reference.indexer_scores`."""
    B, S, H, d = q.shape
    T = keys.shape[1]
    fmt = key_format_of(keys)
    precision = precision or DEFAULT_PRECISION[fmt]
    cfg = default_config(B, S, T, H, fmt)
    for k_, v_ in dict(block_q=block_q, block_t=block_t, num_warps=num_warps, num_stages=num_stages).items():
        if v_ is not None:
            cfg[k_] = v_
    bq, bt = cfg["block_q"], cfg["block_t"]
    Sp = -(-S // bq) * bq
    Tp = -(-T // bt) * bt
    hp = max(16, H)
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
    qparts, n_terms = split_q(qf, fmt, precision)
    op_dtype = jnp.float32 if precision == "f32" else jnp.bfloat16
    kparts = (keys,) if not isinstance(keys, formats.QuantizedKeys) else (keys.values, keys.scale)
    grid = (B, Sp // bq, Tp // bt)
    full = lambda a: pl.BlockSpec(a.shape, lambda b, i, j: (0,) * a.ndim)
    in_specs = [pl.BlockSpec((None, bq), lambda b, i, j: (b, i)), pl.BlockSpec((None, bq, hp), lambda b, i, j: (b, i, 0))]
    in_specs += [pl.BlockSpec((None, bq, hp, p.shape[-1]), lambda b, i, j: (b, i, 0, 0)) for p in qparts]
    in_specs += [full(p) for p in kparts]
    kernel = functools.partial(_kernel, fmt=fmt, n_qparts=len(qparts), n_terms=n_terms, block_q=bq, block_t=bt,
                               T=T, d=d, precision=precision, op_dtype=op_dtype)
    extra = {}
    if not interpret:
        extra["compiler_params"] = plgpu.CompilerParams(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    out = pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs,
        out_specs=pl.BlockSpec((None, bq, bt), lambda b, i, j: (b, i, j)),
        out_shape=jax.ShapeDtypeStruct((B, Sp, Tp), jnp.float32), interpret=interpret,
        name=f"indexer_scores_{fmt}_q{bq}_t{bt}", **extra,
    )(nv, wf, *qparts, *kparts)
    out = out[:, :S]
    return out if pad_to_block else out[..., :T]


def topk_from_scores(scores, k, *, topk="lax", topk_block=4096):
    """scores [..., Tp] (-inf = invalid) -> picks [..., k] int32 sorted by descending score, ties -> lower index,
    -1 where the score is -inf."""
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
                           topk_block: int):
    """`reference.indexer_topk` with the scores from `scores_fn(q, w, keys, n_visible)` (a kernel), in query chunks."""
    k = min(k, keys.shape[1])

    def select(args):
        qc, wc, nc = args
        return topk_from_scores(scores_fn(qc, wc, keys, nc), k, topk=topk, topk_block=topk_block)

    return map_query_chunks(select, (q, weights, n_visible), query_chunk)


def indexer_topk_gpu(q, weights, keys, n_visible, *, k: int, query_chunk: int = 256, interpret=False,
                     topk: str = "lax", topk_block: int = 4096, **kernel_options):
    """Pallas GPU implementation of `reference.indexer_topk` (same arguments and results)."""
    scores = functools.partial(indexer_scores_gpu, interpret=interpret, pad_to_block=True, **kernel_options)
    return topk_over_query_chunks(scores, q, weights, keys, n_visible, k=k, query_chunk=query_chunk, topk=topk,
                                  topk_block=topk_block)
