"""TPU Pallas (Mosaic) kernel for sparse shared-KV MQA with a sink over window + compressed pools.

Grid (query row i of the flattened [B*T] queries, list block j) with j walking the window list's blocks and then
the compressed list's blocks ("arbitrary": the online-softmax state lives in VMEM scratch across j). The index
lists and valid lengths are scalar-prefetched into SMEM; the `block_k` gathered rows of a step come from the pool
(left in HBM, `memory_space=ANY`) into a VMEM buffer, one row copy per entry. Two buffer slots (`double_buffer`,
session 38): step j starts block j + 1's copies into the other slot before it waits for its own, so the gather of
the next block overlaps this block's two matmuls; the prefetch stays within a query row (the row axis is
"parallel", so the next step on a core may be another row's).
Entries that are -1, out of range, or past the valid length are never fetched from their index: the copy reads
row 0 instead and the logit is masked to -inf; whole blocks past the valid length issue no copies at all.
FP8 pools copy their three parts (e4m3 nope, bf16 rope, ue8m0 scales) and are dequantized in VMEM; q is split
into its nope / rope parts outside the kernel so no lane slice at offset 448 is needed.

Row gathers fetch 32-bit word rows (session 50). A TPU array of a 16- or 8-bit type packs 2 or 4 consecutive rows
into each 32-bit word (XLA's tiled layout, (2, 1) / (4, 1) sub-tiles), so one bf16 or e4m3 row is not a unit a DMA
can move: libtpu's Mosaic compiler rejects the single-row slice ("Slice sizes along tiled dimensions must be
aligned to tiles"). Each pool part is therefore viewed as uint32 [rows / pack, width] (`ref.bitcast`, free) and the
word row holding the wanted row is copied; the compute step shifts its 16 / 8 bits out (`_unpack`: row % pack
selects them, even rows in the low bits). This reads pack x the row's bytes: 2x for bf16 pools, ~3.7x for the FP8
rows (e4m3 and scale bytes 4 to a word, the bf16 rope 2). The pools' row counts are padded to a multiple of the
pack where they are not one (a copy of the pool; cache capacities are multiples of 128).

Status: validated in the TPU interpreter (`pltpu.InterpretParams`) on CPU, with and without the second slot;
Pallas' Mosaic lowering for a TPU (v6e) target runs in CI (`tests/test_tpu_lowering.py`), and libtpu compiles it
for a v6e topology on a CPU host (`benchmarks/tpu_offline.py`, session 50). Never run on a TPU (none here), so the
overlap and the word-row gather's cost are designed, not measured.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import common
from .fp8_layout import BLOCK, N_BLOCKS, NOPE_DIM, ROPE_DIM, Fp8KVPool

NEG_INF = -jnp.inf
# The index lists and lengths are scalar-prefetched into SMEM (1 MiB on v5e / v6e); a call whose lists exceed this
# budget runs as several pallas_calls over groups of query rows (session 50: libtpu refused HCA-8K decode at B = 64,
# 2 MiB of indices, and a 4K-query prefill chunk, 10 MiB).
SMEM_INDEX_BUDGET = 512 * 1024


def _pack(dtype) -> int:
    """Rows of `dtype` a 32-bit word row holds on the TPU (1 for 32-bit types)."""
    bits = jnp.dtype(dtype).itemsize * 8
    if 32 % bits:
        raise ValueError(f"pool dtype {jnp.dtype(dtype)} does not pack into 32-bit words")
    return 32 // bits


def _word_rows(a):
    """[rows, width] of a <= 32-bit type -> uint32 [rows / pack, width]: word w of column c holds rows pack w ..
    pack w + pack - 1 of column c, the first in the low bits -- the packing of the TPU's tiled layout, as
    `pltpu.bitcast` defines it for arrays and Mosaic's ref bitcast applies to memory (for the interpreter, which
    has no ref bitcast)."""
    pack = _pack(a.dtype)
    if pack == 1:
        return jax.lax.bitcast_convert_type(a, jnp.uint32)
    rows, width = a.shape
    return jax.lax.bitcast_convert_type(jnp.swapaxes(a.reshape(rows // pack, pack, width), 1, 2), jnp.uint32)


def _unpack(words, shift, dtype):
    """words uint32 [rows, width] (each the 32-bit word row that holds the wanted row), shift uint32 [rows, 1]
    (the wanted row's bit offset in its word: (row % pack) x bits) -> f32 [rows, width], the wanted row's values
    exactly (bf16 / e4m3 / float32), or for uint8 its bytes as int32."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.float32:
        return jax.lax.bitcast_convert_type(words, jnp.float32)
    v = jax.lax.shift_right_logical(words, shift)
    if dtype == jnp.bfloat16:   # bf16 = the high half of an f32
        return jax.lax.bitcast_convert_type(v << 16, jnp.float32)
    byte = (v & 0xFF).astype(jnp.int32)
    if dtype == jnp.uint8:
        return byte
    if dtype != jnp.float8_e4m3fn:
        raise ValueError(f"no unpacking for pool dtype {dtype}")
    e, m = (byte >> 3) & 0xF, byte & 7   # e4m3fn: bias 7; e = 0 subnormal m x 2^-9 (0x7F / 0xFF NaN: never stored)
    normal = jax.lax.bitcast_convert_type(((e + 120) << 23) | (m << 20), jnp.float32)
    val = jnp.where(e == 0, m.astype(jnp.float32) * (2.0 ** -9), normal)
    return jnp.where(byte >= 128, -val, val)


def _kernel(*refs, srcs, block_k, scale, fp8, n_q, double_buffer, dtypes, words_given):
    # scalar prefetch: per source (idx_flat, len); inputs: q parts, sinks, per source pool parts (ANY);
    # outputs: o parts, lse; scratch: per-part kv buffers [slots, block_k, width], m, l, acc parts, DMA semaphores
    # [slots].
    it = iter(refs)
    sp = [(next(it), next(it)) for _ in srcs]
    q_refs = [next(it) for _ in range(n_q)]
    sink_ref = next(it)
    pools = [tuple(next(it) for _ in range(3 if fp8 else 1)) for _ in srcs]
    o_refs = [next(it) for _ in range(n_q)]
    lse_ref = next(it)
    bufs = [next(it) for _ in range(3 if fp8 else 1)]
    m_ref, l_ref = next(it), next(it)
    acc_refs = [next(it) for _ in range(n_q)]
    sem = next(it)
    packs = [_pack(dt) for dt in dtypes]   # per pool part: rows a 32-bit word row holds

    i = pl.program_id(0)
    j = pl.program_id(1)
    n_j = pl.num_programs(1)

    @pl.when(j == 0)
    def _init():
        m_ref[...] = sink_ref[...]
        l_ref[...] = jnp.zeros_like(l_ref)
        for a in acc_refs:
            a[...] = jnp.zeros_like(a)

    def on_block(g, fn):
        """fn(source index, start, length) for the source that holds list block g (grid step g of this row) where
        the block holds an entry below the row's valid length; blocks past it issue no copies and no compute."""
        base = 0
        for s_i, src in enumerate(srcs):
            nb = src["k"] // block_k
            length = sp[s_i][1][i]
            start = (g - base) * block_k
            pl.when((g >= base) & (g < base + nb) & (start < length))(
                functools.partial(fn, s_i, start, length))
            base += nb

    def copies(slot, for_wait=False):
        """fn(source, start, length) -> the row copies of the block at `start` of that source's list into buffer
        slot `slot` (one per entry and pool part, all on the slot's semaphore): entries that are -1, out of range or
        past the valid length copy row 0 and are masked later. for_wait: descriptors to wait on (same sizes and
        semaphore; the rows they name do not matter, so no index is read)."""
        def each(s_i, start, length):
            idx_ref, k, n_rows = sp[s_i][0], srcs[s_i]["k"], srcs[s_i]["n_rows"]
            # [rows / pack, width]: free views (the interpreter, which has no ref bitcast, gets them made outside)
            words = pools[s_i] if words_given else [part.bitcast(jnp.uint32) for part in pools[s_i]]
            out = []
            for r in range(block_k):
                if for_wait:
                    safe = 0
                else:
                    row = idx_ref[i * k + start + r]
                    safe = jnp.where((row >= 0) & (row < n_rows) & (start + r < length), row, 0)
                for w, pack, buf in zip(words, packs, bufs):   # the word row that holds row `safe`
                    out.append(pltpu.make_async_copy(w.at[pl.ds(safe // pack, 1)], buf.at[slot, pl.ds(r, 1)],
                                                     sem.at[slot]))
            return out
        return each

    def issue(g, slot):
        def start_all(*a):
            for cp in copies(slot)(*a):
                cp.start()
        on_block(g, start_all)

    def compute(s_i, start, length, slot):
        idx_ref, k, n_rows = sp[s_i][0], srcs[s_i]["k"], srcs[s_i]["n_rows"]
        row_iota = jax.lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
        col_iota = jax.lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)
        # int32 0 / 1, not bool: Mosaic's compiler has no layout for selects between i1 vectors (libtpu, session 50)
        mask = jnp.zeros((1, block_k), jnp.int32)
        sub = jnp.zeros((block_k, 1), jnp.int32)     # each entry's row within its word row (row % pack, as copied)
        for r in range(block_k):
            row = idx_ref[i * k + start + r]
            ok = (row >= 0) & (row < n_rows) & (start + r < length)
            mask = jnp.where(row_iota == r, ok.astype(jnp.int32), mask)
            sub = jnp.where(col_iota == r, jnp.where(ok, row, 0), sub)
        parts = [_unpack(buf[slot], ((sub % pack) * (32 // pack)).astype(jnp.uint32), dt)
                 for buf, pack, dt in zip(bufs, packs, dtypes)]
        if fp8:
            nope = parts[0]  # [bk, 448]
            sbits = parts[2][:, :N_BLOCKS]  # [bk, 7]
            sc = jax.lax.bitcast_convert_type(sbits << 23, jnp.float32)
            expand = (jax.lax.broadcasted_iota(jnp.int32, (N_BLOCKS, NOPE_DIM), 1) // BLOCK
                      == jax.lax.broadcasted_iota(jnp.int32, (N_BLOCKS, NOPE_DIM), 0)).astype(jnp.float32)
            sc_full = jnp.dot(sc, expand, precision=jax.lax.Precision.HIGHEST)  # exact: one term per column
            kvs = [(nope * sc_full).astype(jnp.bfloat16), parts[1].astype(jnp.bfloat16)]
        else:
            kvs = [parts[0].astype(jnp.bfloat16)]
        logits = None
        for q_ref, kv in zip(q_refs, kvs):
            part = jax.lax.dot_general(q_ref[...].astype(jnp.bfloat16), kv, (((1,), (1,)), ((), ())),
                                       preferred_element_type=jnp.float32)
            logits = part if logits is None else logits + part
        logits = jnp.where(mask != 0, logits * scale, NEG_INF)  # [Hp, bk]
        m_prev = m_ref[...]
        m_new = jnp.maximum(m_prev, jnp.max(logits, axis=1, keepdims=True))
        alpha = jnp.exp(m_prev - m_new)
        p = jnp.exp(logits - m_new)
        l_ref[...] = l_ref[...] * alpha + jnp.sum(p, axis=1, keepdims=True)
        m_ref[...] = m_new
        pb = p.astype(jnp.bfloat16)
        for a, kv in zip(acc_refs, kvs):
            a[...] = a[...] * alpha + jnp.dot(pb, kv, preferred_element_type=jnp.float32)

    def step(s_i, start, length, slot):
        """Wait for this block's copies (descriptors of the same shapes on the same semaphore), then compute."""
        for cp in copies(slot, for_wait=True)(s_i, start, length):
            cp.wait()
        compute(s_i, start, length, slot)

    if double_buffer:
        # Two buffer slots: block j + 1's copies are in flight while block j computes. Slot (j + 1) % 2 last held
        # block j - 1, whose compute finished in the previous step. Prefetching stays within this query row (the
        # next grid step on this core may belong to another row when the row axis is split across cores).
        slot = j % 2

        @pl.when(j == 0)
        def _first():
            issue(0, 0)

        @pl.when(j + 1 < n_j)
        def _next():
            issue(j + 1, 1 - slot)

        on_block(j, lambda *a: step(*a, slot))
    else:   # copies started and waited for within the step
        issue(j, 0)
        on_block(j, lambda *a: step(*a, 0))

    @pl.when(j == n_j - 1)
    def _final():
        m = m_ref[...]
        l = l_ref[...]
        inv = 1.0 / (l + jnp.exp(sink_ref[...] - m))
        for o_ref, a in zip(o_refs, acc_refs):
            o_ref[...] = (a[...] * inv).astype(o_ref.dtype)
        has = l > 0
        lse_ref[...] = jnp.where(has, m + jnp.log(jnp.where(has, l, 1.0)), NEG_INF)


def sparse_attention_tpu(
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
    block_k: int = 64,
    double_buffer: bool = True,
):
    """Mosaic TPU implementation of `reference.sparse_attention` (same arguments and results).
    Both pools must be of one kind (both plain arrays or both Fp8KVPool). `interpret=True` runs the TPU
    interpreter (`pltpu.InterpretParams()`) on CPU. double_buffer: gather block j + 1's rows while block j
    computes (two VMEM buffer slots); False waits for each block's copies before its compute."""
    b, t, h, d = common.validate(q, window_kv, window_idx, compressed_kv, compressed_idx, sinks, window_len,
                                 compressed_len, scale)
    fp8 = isinstance(window_kv, Fp8KVPool)
    if compressed_kv is not None and isinstance(compressed_kv, Fp8KVPool) != fp8:
        raise ValueError("the TPU kernel needs both pools of one kind (both Fp8KVPool or both arrays)")
    if not fp8 and compressed_kv is not None and compressed_kv.dtype != window_kv.dtype:
        raise ValueError(f"pool dtypes differ: {window_kv.dtype} vs {compressed_kv.dtype}")
    if not fp8 and jnp.dtype(window_kv.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        raise ValueError(f"the TPU kernel takes bf16, float32 or Fp8KVPool pools (Mosaic TPU kernels take no "
                         f"{jnp.dtype(window_kv.dtype)} arguments), got {jnp.dtype(window_kv.dtype)}")
    out_dtype = jnp.dtype(out_dtype or q.dtype)
    bt = b * t
    hp = -(-h // 8) * 8
    srcs = [common.flatten_source(window_kv, window_idx, window_len, bt, block_k)]
    if compressed_kv is not None:
        srcs.append(common.flatten_source(compressed_kv, compressed_idx, compressed_len, bt, block_k))
    n_blocks = sum(s.k // block_k for s in srcs)

    qf = q.reshape(bt, h, d)
    sk = sinks.astype(jnp.float32)
    if hp != h:
        qf = jnp.pad(qf, ((0, 0), (0, hp - h), (0, 0)))
        sk = jnp.pad(sk, (0, hp - h))
    q_parts = [qf[..., :NOPE_DIM], qf[..., NOPE_DIM:]] if fp8 else [qf]
    scalars = []
    for s in srcs:
        scalars += [s.idx.reshape(-1), s.length]
    pool_args = []
    for s in srcs:
        pool_args += [s.pool.nope, s.pool.rope, s.pool.scale] if fp8 else [s.pool]
    dtypes = [a.dtype for a in pool_args[:3 if fp8 else 1]]
    pad_to = max(_pack(dt) for dt in dtypes)   # the word-row views need whole word rows
    pool_args = [a if a.shape[0] % pad_to == 0 else jnp.pad(a, ((0, -a.shape[0] % pad_to), (0, 0)))
                 for a in pool_args]
    if interpret:   # the TPU interpreter's DMAs take no bitcast ref: the word-row views as arrays (same packing)
        pool_args = [_word_rows(a) for a in pool_args]
    widths = [qp.shape[-1] for qp in q_parts]

    q_spec = lambda w: pl.BlockSpec((None, hp, w), lambda i, j, *_: (i, 0, 0))
    in_specs = [q_spec(w) for w in widths] + [pl.BlockSpec((hp, 1), lambda i, j, *_: (0, 0))]
    in_specs += [pl.BlockSpec(memory_space=pl.ANY)] * len(pool_args)
    out_specs = [q_spec(w) for w in widths] + [pl.BlockSpec((None, hp, 1), lambda i, j, *_: (i, 0, 0))]
    out_shape = [jax.ShapeDtypeStruct((bt, hp, w), out_dtype) for w in widths]
    out_shape.append(jax.ShapeDtypeStruct((bt, hp, 1), jnp.float32))
    slots = 2 if double_buffer else 1
    # the gathered word rows, uint32 [slots, block_k, width] per pool part
    bufs = [pltpu.VMEM((slots, block_k, a.shape[1]), jnp.uint32) for a in pool_args[:len(dtypes)]]
    scratch = bufs + [pltpu.VMEM((hp, 1), jnp.float32), pltpu.VMEM((hp, 1), jnp.float32)]
    scratch += [pltpu.VMEM((hp, w), jnp.float32) for w in widths] + [pltpu.SemaphoreType.DMA((slots,))]

    kernel = functools.partial(_kernel, srcs=[dict(k=s.k, n_rows=s.n_rows) for s in srcs], block_k=block_k,
                               scale=float(scale), fp8=fp8, n_q=len(q_parts), double_buffer=bool(double_buffer),
                               dtypes=tuple(jnp.dtype(dt) for dt in dtypes), words_given=bool(interpret))

    def run(r0, r1):   # query rows [r0, r1): their index lists and lengths fit the SMEM budget
        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(scalars), grid=(r1 - r0, n_blocks), in_specs=in_specs, out_specs=out_specs,
            scratch_shapes=scratch)
        rows = lambda a: a[r0 * a.shape[0] // bt:r1 * a.shape[0] // bt]   # idx is flat [bt * k], lengths [bt]
        return pl.pallas_call(
            kernel,
            grid_spec=grid_spec,
            out_shape=[jax.ShapeDtypeStruct((r1 - r0,) + o.shape[1:], o.dtype) for o in out_shape],
            interpret=pltpu.InterpretParams() if interpret else False,
            compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
            name="sparse_attention_tpu",
        )(*[rows(a) for a in scalars], *[qp[r0:r1] for qp in q_parts], sk[:, None], *pool_args)

    per_row = 4 * (sum(s.k for s in srcs) + len(srcs))   # SMEM bytes a query row's lists and lengths take
    rows_per_call = max(1, min(bt, SMEM_INDEX_BUDGET // per_row))
    calls = [run(r0, min(bt, r0 + rows_per_call)) for r0 in range(0, bt, rows_per_call)]
    outs = calls[0] if len(calls) == 1 else [jnp.concatenate(parts, axis=0) for parts in zip(*calls)]
    o = outs[0] if len(widths) == 1 else jnp.concatenate(outs[:-1], axis=-1)
    lse = outs[-1][..., 0]
    o = o[:, :h].reshape(b, t, h, d)
    lse = lse[:, :h].reshape(b, t, h)
    return (o, lse) if return_lse else o
