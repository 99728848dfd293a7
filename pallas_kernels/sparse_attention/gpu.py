"""GPU Pallas (Triton backend) kernel for sparse shared-KV MQA with a sink over window + compressed pools.

One program = (query row i of the flattened [B*T] queries, split s of the concatenated index list, head block h).
It holds `block_h` heads of q ([block_h, 512] split into `d_chunk`-wide pieces), walks the window list and then
the compressed list in blocks of `block_k` entries, gathers the rows (masked loads: invalid / out-of-range /
past-length entries are not read), and runs an online softmax whose running max starts at the sink logit (so
`m` is always finite). FP8 pools (`Fp8KVPool`) are dequantized in registers: e4m3 x 2^(ue8m0-127) per 64-block,
bf16 RoPE part. Scores and P.V run on the tensor cores in bf16 with f32 accumulation (P rounded to bf16 as in
spec §3.10).

split-K (`num_splits > 1`): each split writes its partial output normalised by its own sum plus its lse; a small
XLA epilogue (`common.combine_splits`) merges them and applies the sink. Used when B*T*head_blocks programs
cannot fill the GPU (decode at small batch).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

try:  # jax >= 0.4.3x
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover
    plgpu = None

from . import combine as combine_lib
from . import common
from .fp8_layout import NOPE_DIM, Fp8KVPool

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


def _dot_nt(a, b):
    """a [M, K] @ b[N, K].T -> [M, N] f32 (float32 operands: full precision, no TF32)."""
    return plgpu.dot(a, b, trans_b=True, allow_tf32=False if a.dtype == jnp.float32 else None)


def _dot(a, b):
    return plgpu.dot(a, b, allow_tf32=False if a.dtype == jnp.float32 else None)


def _gather(ref, rows, col0, width, mask, other, interpret):
    """ref[rows, col0:col0+width] (width None: ref[rows, col0]) as a masked gather load."""
    if interpret:  # the interpreter's load discharge does not mix array and slice indexers
        if width is None:
            return plgpu.load(ref.at[rows, jnp.full(rows.shape, col0, jnp.int32)], mask=mask, other=other)
        cols = col0 + jax.lax.broadcasted_iota(jnp.int32, (1, width), 1)
        return plgpu.load(ref.at[rows[:, None], cols], mask=mask, other=other)
    if width is None:
        return plgpu.load(ref.at[rows, col0], mask=mask, other=other)
    return plgpu.load(ref.at[rows, pl.ds(col0, width)], mask=mask, other=other)


def _kernel(*refs, srcs, block_h, block_k, d, d_chunk, n_splits, blocks_per_split, scale2, out_split, interpret,
            compute_dtype=jnp.bfloat16, fp8_scales="per_chunk", col_splits=1, prefetch=None, q_reload=False):
    # compute_dtype: MMA operand dtype — bf16 for bf16/fp8 inputs, f32 when q is f32 (exact-mode parity).
    # refs: q, sinks, then per source (idx, len, pool parts...), then outputs (o, lse)
    it = iter(refs)
    q_ref = next(it)
    sink_ref = next(it)
    src_refs = []
    for src in srcs:
        idx_ref, len_ref = next(it), next(it)
        parts = (next(it), next(it), next(it)) if src["fp8"] else (next(it),)
        src_refs.append((idx_ref, len_ref, parts))
    rest = list(it)
    o_ref, lse_ref = rest[-2], rest[-1]  # (poisoned initial outputs, if any, come before them)

    i = pl.program_id(0)
    s = pl.program_id(1)
    any_fp8 = any(src["fp8"] for src in srcs)
    chunks = _chunks(d, d_chunk, any_fp8)  # [(offset, width)]: FP8 chunks never straddle the 448 | 64 seam
    if col_splits == 1:
        _attend(0, i, s, q_ref, sink_ref, src_refs, o_ref, lse_ref, srcs, chunks, block_h, block_k, d,
                blocks_per_split, scale2, out_split, interpret, compute_dtype, fp8_scales, 1, prefetch, q_reload)
        return
    cs = pl.program_id(2) % col_splits
    for c in range(col_splits):  # one static copy of the sweep per output column range
        pl.when(cs == c)(functools.partial(
            _attend, c, i, s, q_ref, sink_ref, src_refs, o_ref, lse_ref, srcs, chunks, block_h, block_k, d,
            blocks_per_split, scale2, out_split, interpret, compute_dtype, fp8_scales, col_splits, prefetch,
            q_reload))


def _attend(c, i, s, q_ref, sink_ref, src_refs, o_ref, lse_ref, srcs, chunks, block_h, block_k, d,
            blocks_per_split, scale2, out_split, interpret, compute_dtype, fp8_scales, col_splits, prefetch,
            q_reload=False):
    """The sweep of one program. Scores use every head_dim chunk; P.V and the output cover the chunks of column
    range c of `col_splits` ([c * d / col_splits, (c + 1) * d / col_splits)): o_ref holds only that range.
    q_reload: q's chunks are loaded again (L1 / L2 hits) in every step instead of living in registers across the
    loop ([64, 512] bf16 q is 64 registers a thread at 8 warps, next to the 128 of the f32 accumulator)."""
    dcol = d // col_splits
    own = [j for j, (off, _) in enumerate(chunks) if c * dcol <= off < (c + 1) * dcol]
    cdt = compute_dtype
    load_q = lambda j_: q_ref[:, pl.ds(chunks[j_][0], chunks[j_][1])].astype(cdt)
    qs = None if q_reload else [load_q(j_) for j_ in range(len(chunks))]
    sink2 = sink_ref[...].astype(jnp.float32) * LOG2E  # [block_h]

    m = sink2
    l = jnp.zeros((block_h,), jnp.float32)
    acc = tuple(jnp.zeros((block_h, chunks[j][1]), jnp.float32) for j in own)

    lo_blk = s * blocks_per_split
    hi_blk = lo_blk + blocks_per_split
    blk_base = 0
    for src, (idx_ref, len_ref, parts) in zip(srcs, src_refs):
        nb = src["k"] // block_k
        length = len_ref[i]
        nb_valid = (length + block_k - 1) // block_k
        lo = jnp.clip(lo_blk - blk_base, 0, nb_valid)
        hi = jnp.clip(hi_blk - blk_base, 0, nb_valid)
        n_rows = src["n_rows"]
        fp8 = src["fp8"]

        def load_idx(j, idx_ref=idx_ref, nb=nb):
            return idx_ref[pl.ds(jnp.minimum(j, nb - 1) * block_k, block_k)]   # clamped: a prefetch past the end

        def fetch(j, idx, live, parts=parts, length=length, n_rows=n_rows, fp8=fp8):
            """Block j's rows (gathered, dequantized, in cdt) and validity; nothing is read unless `live`."""
            pos = j * block_k + jax.lax.iota(jnp.int32, block_k)
            valid = (idx >= 0) & (idx < n_rows) & (pos < length) & live
            safe = jnp.where(valid, idx, 0)
            kvs = []
            if fp8 and fp8_scales == "vector":  # the row's 8 scale bytes in one load, split per chunk in registers
                sb8 = _gather(parts[2], safe, 0, 8, valid[:, None], 127, interpret).astype(jnp.int32)
                col8 = jax.lax.broadcasted_iota(jnp.int32, (1, 8), 1)
            for off, w in chunks:
                if not fp8:
                    kv = _gather(parts[0], safe, off, w, valid[:, None], 0.0, interpret)
                    kvs.append(kv.astype(cdt))
                elif off < NOPE_DIM:
                    nope_ref, _, scale_ref = parts
                    raw = _gather(nope_ref, safe, off, w, valid[:, None], 0.0, interpret)
                    blocks = []  # one ue8m0 exponent byte [block_k] per 64-block of the chunk
                    for b_ in range(off // 64, (off + w) // 64):
                        if fp8_scales == "vector":
                            blocks.append(jnp.sum(jnp.where(col8 == b_, sb8, 0), axis=1))
                        else:
                            blocks.append(_gather(scale_ref, safe, b_, None, valid, 127, interpret).astype(jnp.int32))
                    sb = blocks[0][:, None]
                    if len(blocks) == 2:  # a 128-wide chunk: its two blocks' exponents side by side
                        col = jax.lax.broadcasted_iota(jnp.int32, (1, w), 1)
                        sb = jnp.where(col < 64, blocks[0][:, None], blocks[1][:, None])
                    sc = jax.lax.bitcast_convert_type(sb << 23, jnp.float32)      # 2^(byte - 127), [block_k, 1|w]
                    if cdt == jnp.float16:  # e4m3 -> f16 is one exact conversion; x 2^e is exact in f16's range
                        kvs.append(raw.astype(jnp.float16) * sc.astype(jnp.float16))
                    else:
                        kvs.append((raw.astype(jnp.float32) * sc).astype(cdt))
                else:
                    rope_ref = parts[1]
                    kv = _gather(rope_ref, safe, off - NOPE_DIM, w, valid[:, None], 0.0, interpret)
                    kvs.append(kv.astype(cdt))
            return valid, tuple(kvs)

        def step(m, l, acc, valid, kvs):
            """Online-softmax update with one block of rows."""
            q_of = load_q if q_reload else qs.__getitem__
            sc2 = _dot_nt(q_of(0), kvs[0])
            for c_ in range(1, len(chunks)):
                sc2 += _dot_nt(q_of(c_), kvs[c_])
            logits = jnp.where(valid[None, :], sc2 * scale2, -jnp.inf)  # [block_h, block_k], log2 units
            m_new = jnp.maximum(m, jnp.max(logits, axis=1))
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(logits - m_new[:, None])
            l = l * alpha + jnp.sum(p, axis=1)
            pb = p.astype(cdt)
            acc = tuple(a * alpha[:, None] + _dot(pb, kvs[j_]) for a, j_ in zip(acc, own))
            return m_new, l, acc

        if prefetch is None:
            def body(j, carry):
                valid, kvs = fetch(j, load_idx(j), True)
                return step(*carry, valid, kvs)

            m, l, acc = jax.lax.fori_loop(lo, hi, body, (m, l, acc))
        elif prefetch == "idx":  # block j + 1's index list loads while block j's rows are gathered and used
            def body(j, carry):
                m, l, acc, idx = carry
                nxt = load_idx(j + 1)
                valid, kvs = fetch(j, idx, True)
                return (*step(m, l, acc, valid, kvs), nxt)

            m, l, acc, _ = jax.lax.fori_loop(lo, hi, body, (m, l, acc, load_idx(lo)))
        else:  # "rows": block j + 1's rows are gathered (into registers) before block j's MMAs
            def body(j, carry, hi=hi):
                m, l, acc, valid, kvs = carry
                nxt = fetch(j + 1, load_idx(j + 1), j + 1 < hi)
                return (*step(m, l, acc, valid, kvs), *nxt)

            m, l, acc, _, _ = jax.lax.fori_loop(lo, hi, body, (m, l, acc, *fetch(lo, load_idx(lo), lo < hi)))
        blk_base += nb

    has = l > 0
    lse = jnp.where(has, (m + jnp.log2(jnp.where(has, l, 1.0))) * LN2, -jnp.inf)
    if out_split:
        inv = jnp.where(has, 1.0 / jnp.where(has, l, 1.0), 0.0)
    else:
        inv = 1.0 / (l + jnp.exp2(sink2 - m))
    for j, a in zip(own, acc):
        off, w = chunks[j]
        o_ref[:, pl.ds(off - c * dcol, w)] = (a * inv[:, None]).astype(o_ref.dtype)
    lse_ref[...] = lse


def _chunks(d: int, d_chunk: int, any_fp8: bool):
    """head_dim pieces [(offset, width)] the kernel holds q / accumulates o in. bf16 pools: d / d_chunk equal
    pieces. FP8 pools: the 448 e4m3 dims in pieces of d_chunk (64 or 128) whole 64-blocks, the last one cut at the
    448 seam (448 = 3 x 128 + 64), then the 64 bf16 RoPE dims as one piece."""
    if not any_fp8:
        return [(c * d_chunk, d_chunk) for c in range(d // d_chunk)]
    if d != NOPE_DIM + 64 or d_chunk not in (64, 128):
        raise ValueError(f"FP8 pools need head_dim {NOPE_DIM + 64} and d_chunk 64 or 128, got {d}, {d_chunk}")
    out, off = [], 0
    while off < NOPE_DIM:
        w = min(d_chunk, NOPE_DIM - off)
        out.append((off, w))
        off += w
    return out + [(NOPE_DIM, 64)]


def default_config(bt: int, h: int, total_k: int, any_fp8: bool, prefill: bool, col_splits: int = 1, d: int = 512,
                   q_bytes: int = 2):
    """Defaults picked from the H200 sweep (benchmarks/NOTES_sparse_attention.md): 64 heads x 64 entries per
    step, 8 warps; split-K so that about one program per SM runs when B*T*head_blocks*col_splits is below the SM
    count; past one wave of programs, for decode shapes, `common.wave_splits` (`common.split_count`, shared with the
    Mosaic kernel: one split a row left a second wave as long as the first, HCA-8K B = 136 1146.3 us against 577.2
    at B = 128 on the H100, 743.2 with 4 splits; B = 160 1132.6 -> 760.1; session 58, results/h100_s58r4_dk.log)."""
    # an f32 q at head_dim 512 overflows the H200's 232,448 B of shared memory on the defaults (session 28): with
    # bf16 rows Triton takes them to f32 for the dot, 64 x 512 x 4 B a stage (3 stages asked for 262,656 B, 2 for
    # 262,400); with FP8 rows 64 heads a program asked for 315,648 B. 16 heads keep q's f32 tile at 32 KB, and over
    # bf16 rows 32 rows x 2 stages halve the staging; bf16 q keeps 64 heads x 64 rows x 3 stages
    f32_q = q_bytes > 2 and d >= 512
    block_h = 64 if h >= 64 and not f32_q else 16
    block_k = 64
    n_hb = -(-h // block_h)
    programs = bt * n_hb * col_splits
    total_blocks = -(-total_k // block_k)
    n_splits = common.split_count(programs, total_blocks, not prefill, block_k)
    num_stages = 2 if any_fp8 else 3
    if f32_q and not any_fp8:
        block_k, num_stages = 32, 2
    return dict(block_h=block_h, block_k=block_k, n_splits=n_splits, num_warps=8 if block_h >= 64 else 4,
                num_stages=num_stages, d_chunk=64 if any_fp8 else 128)


def sparse_attention_gpu(
    q,
    window_kv,
    window_idx,
    compressed_kv,
    compressed_idx,
    sinks,
    *,
    scale: float,
    window_len=None,
    compressed_len=None,
    out_dtype=None,
    return_lse: bool = False,
    interpret: bool = False,
    block_h: int | None = None,
    block_k: int | None = None,
    n_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    d_chunk: int | None = None,
    partial_dtype=None,
    fp8_scales: str = "vector",
    fp8_operands: str = "bf16",
    col_splits: int = 1,
    prefetch: str | None = None,
    q_reload: bool = False,
    combine: str | None = None,
    poison: bool = False,
):
    """Pallas GPU (Triton) implementation of `reference.sparse_attention` (same arguments and results).

    Extra keyword-only tuning knobs: block_h (heads per program, >= 16, power of 2), block_k (entries per step,
    power of 2), n_splits (split-K factor), num_warps, num_stages, d_chunk (head_dim chunk; FP8 pools: 64 (default)
    or 128, two scale blocks per chunk),
    partial_dtype (split-K partial outputs; default: bf16 when the output is bf16, else float32 -- bf16 partials
    were 4-8% faster on the H200, see benchmarks/NOTES_sparse_attention.md), fp8_scales ("vector" (default): the
    row's 8 scale bytes in one load; "per_chunk": one 1-byte gather per 64-block and row), fp8_operands (MMA
    operand dtype when a pool is FP8: "bf16" (default; e4m3 -> f32 -> x scale -> bf16, exact for any scale) or
    "f16" (q, P and the rows in f16: e4m3 -> f16 is one conversion and x 2^e stays exact while the dequantized
    values lie in f16's normal range, |x| <= 65504 and scale >= 2^-15 -- true for RMS-normed KV and q; f16 also
    keeps 3 more mantissa bits of q and P than bf16), col_splits (programs per (query row, split, head block),
    each owning d / col_splits output columns: every one computes the full scores but P.V only for its columns,
    so its accumulator and live value rows shrink by col_splits at the price of repeating q.K (1.5x the FLOPs at
    col_splits 2; the repeated row reads mostly hit L2); the column ranges must fall on d_chunk boundaries;
    measured 1.3-2.4x slower on the H200), prefetch (manual software pipelining of the entry loop: None (Triton's
    own pipelining only), "idx" (block j + 1's index list is loaded during block j, so the gather addresses do not
    wait on it), "rows" (block j + 1's rows are gathered into registers before block j's MMAs; more registers); the default
    num_stages becomes 2 with "idx" over bf16 pools and 1 with "rows"; both measured slower on the H200, session 7),
    q_reload (q's head_dim chunks loaded in every step of the entry loop instead of held in registers across it),
    combine (split-K merge: "xla" = `common.combine_splits`, "pallas" = `combine.combine_splits_pallas`, one
    kernel; None = `combine.DEFAULT_COMBINE`).
    `interpret=True` runs the kernel in the Pallas interpreter (CPU tests). `poison=True` (tests) aliases the
    kernel outputs to NaN-filled buffers so an element the kernel fails to write shows up as NaN."""
    b, t, h, d = common.validate(q, window_kv, window_idx, compressed_kv, compressed_idx, sinks, window_len,
                                 compressed_len, scale)
    if d % 64:
        raise ValueError(f"head_dim must be a multiple of 64 for the GPU kernel, got {d}")
    combine = combine_lib.resolve(combine)
    out_dtype = jnp.dtype(out_dtype or q.dtype)
    bt = b * t
    any_fp8 = isinstance(window_kv, Fp8KVPool) or isinstance(compressed_kv, Fp8KVPool)
    total_k = window_idx.shape[-1] + (0 if compressed_idx is None else compressed_idx.shape[-1])
    cfg = default_config(bt, h, total_k, any_fp8, t > 8, col_splits, d, jnp.dtype(q.dtype).itemsize)
    if prefetch == "idx" and not any_fp8:
        # with the index list prefetched, Triton's pipeliner also stages the gathered rows: 3 stages of 64 x 512
        # bf16 rows ask for 256 KB of shared memory (over the H200's 227 KB, seen on the GPU)
        cfg["num_stages"] = 2
    elif prefetch == "rows":
        cfg["num_stages"] = 1  # the loop carries the next block's rows itself
    for k_, v_ in dict(block_h=block_h, block_k=block_k, n_splits=n_splits, num_warps=num_warps,
                       num_stages=num_stages, d_chunk=d_chunk).items():
        if v_ is not None:
            cfg[k_] = v_
    bh, bk = cfg["block_h"], cfg["block_k"]
    dc = cfg["d_chunk"] if d_chunk is not None else math.gcd(cfg["d_chunk"], d)  # defaults fit small test dims
    if d % dc:
        raise ValueError(f"d_chunk {dc} must divide head_dim {d}")
    if prefetch not in (None, "idx", "rows"):
        raise ValueError(f"prefetch must be None, 'idx' or 'rows', got {prefetch!r}")
    if fp8_operands not in ("bf16", "f16"):
        raise ValueError(f"fp8_operands must be 'bf16' or 'f16', got {fp8_operands!r}")
    chunks = _chunks(d, dc, any_fp8)  # validates head_dim / d_chunk for FP8 pools
    if col_splits < 1 or d % col_splits or any(off // (d // col_splits) != (off + w - 1) // (d // col_splits)
                                               for off, w in chunks):
        raise ValueError(f"col_splits {col_splits} must split head_dim {d} on d_chunk boundaries "
                         f"(chunks {[off for off, _ in chunks]})")
    hp = -(-h // bh) * bh
    n_hb = hp // bh
    CS = col_splits
    dcol = d // CS

    srcs = [common.flatten_source(window_kv, window_idx, window_len, bt, bk)]
    if compressed_kv is not None:
        srcs.append(common.flatten_source(compressed_kv, compressed_idx, compressed_len, bt, bk))
    total_blocks = sum(s_.k // bk for s_ in srcs)
    ns = max(1, min(int(cfg["n_splits"]), total_blocks))
    bps = -(-total_blocks // ns)
    ns = -(-total_blocks // bps)

    qf = q.reshape(bt, h, d)
    sk = sinks.astype(jnp.float32)
    if hp != h:
        qf = jnp.pad(qf, ((0, 0), (0, hp - h), (0, 0)))
        sk = jnp.pad(sk, (0, hp - h))

    # grid axis 2 = head block x column range (g = hb * CS + c): the programs sharing rows are neighbours
    full = lambda shape: pl.BlockSpec(shape, lambda i, s, g: (0,) * len(shape))
    args = [qf, sk]
    in_specs = [pl.BlockSpec((None, bh, d), lambda i, s, g: (i, g // CS, 0)),
                pl.BlockSpec((bh,), lambda i, s, g: (g // CS,))]
    meta = []
    for src in srcs:
        args += [src.idx, src.length]
        in_specs += [pl.BlockSpec((None, src.k), lambda i, s, g: (i, 0)), full((bt,))]
        parts = (src.pool.nope, src.pool.rope, src.pool.scale) if src.fp8 else (src.pool,)
        for p_ in parts:
            args.append(p_)
            in_specs.append(full(p_.shape))
        meta.append(dict(k=src.k, n_rows=src.n_rows, fp8=src.fp8))

    out_split = ns > 1
    if out_split:
        pdt = jnp.dtype(partial_dtype or (jnp.bfloat16 if out_dtype == jnp.bfloat16 else jnp.float32))
        out_shape = [jax.ShapeDtypeStruct((bt, ns, hp, d), pdt), jax.ShapeDtypeStruct((bt, ns, hp), jnp.float32)]
        out_specs = [pl.BlockSpec((None, None, bh, dcol), lambda i, s, g: (i, s, g // CS, g % CS)),
                     pl.BlockSpec((None, None, bh), lambda i, s, g: (i, s, g // CS))]
    else:
        out_shape = [jax.ShapeDtypeStruct((bt, hp, d), out_dtype), jax.ShapeDtypeStruct((bt, hp), jnp.float32)]
        out_specs = [pl.BlockSpec((None, bh, dcol), lambda i, s, g: (i, g // CS, g % CS)),
                     pl.BlockSpec((None, bh), lambda i, s, g: (i, g // CS))]

    aliases = {}
    if poison:
        n_in = len(args)
        for j, (shp, spec) in enumerate(zip(out_shape, out_specs)):
            args.append(jnp.full(shp.shape, jnp.nan, shp.dtype))
            in_specs.append(spec)
            aliases[n_in + j] = j

    kernel = functools.partial(
        _kernel, srcs=meta, block_h=bh, block_k=bk, d=d, d_chunk=dc, n_splits=ns, blocks_per_split=bps,
        scale2=float(scale) * LOG2E, out_split=out_split, interpret=interpret,
        compute_dtype=(jnp.float32 if q.dtype == jnp.float32 else
                       jnp.float16 if any_fp8 and fp8_operands == "f16" else jnp.bfloat16), fp8_scales=fp8_scales,
        col_splits=CS, prefetch=prefetch, q_reload=bool(q_reload))
    extra = {}
    if not interpret:
        extra["compiler_params"] = plgpu.CompilerParams(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    o, lse = pl.pallas_call(
        kernel,
        grid=(bt, ns, n_hb * CS),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        input_output_aliases=aliases,
        name=f"sparse_attn_bh{bh}_bk{bk}_s{ns}" + (f"_c{CS}" if CS > 1 else ""),
        **extra,
    )(*args)
    if out_split:
        o, lse = combine_lib.combine(o, lse, sk, out_dtype, how=combine, interpret=interpret)
    o = o[:, :h].reshape(b, t, h, d)
    lse = lse[:, :h].reshape(b, t, h)
    if return_lse:
        return o, lse
    return o
