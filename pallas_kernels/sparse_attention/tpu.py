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

Status: validated in the TPU interpreter (`pltpu.InterpretParams`) on CPU, with and without the second slot, and
Pallas' Mosaic lowering for a TPU (v6e) target runs in CI (`tests/test_tpu_lowering.py`); no TPU compile (libtpu)
has been run, so the overlap is designed, not measured.
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


def _kernel(*refs, srcs, block_k, scale, fp8, n_q, double_buffer):
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
            out = []
            for r in range(block_k):
                if for_wait:
                    safe = 0
                else:
                    row = idx_ref[i * k + start + r]
                    safe = jnp.where((row >= 0) & (row < n_rows) & (start + r < length), row, 0)
                for part, buf in zip(pools[s_i], bufs):
                    out.append(pltpu.make_async_copy(part.at[pl.ds(safe, 1)], buf.at[slot, pl.ds(r, 1)],
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
        mask = jnp.zeros((1, block_k), jnp.bool_)
        for r in range(block_k):
            row = idx_ref[i * k + start + r]
            ok = (row >= 0) & (row < n_rows) & (start + r < length)
            mask = jnp.where(row_iota == r, ok, mask)
        if fp8:
            nope = bufs[0][slot].astype(jnp.float32)  # [bk, 448]
            sbits = bufs[2][slot].astype(jnp.int32)[:, :N_BLOCKS]  # [bk, 7]
            sc = jax.lax.bitcast_convert_type(sbits << 23, jnp.float32)
            expand = (jax.lax.broadcasted_iota(jnp.int32, (N_BLOCKS, NOPE_DIM), 1) // BLOCK
                      == jax.lax.broadcasted_iota(jnp.int32, (N_BLOCKS, NOPE_DIM), 0)).astype(jnp.float32)
            sc_full = jnp.dot(sc, expand, precision=jax.lax.Precision.HIGHEST)  # exact: one term per column
            kvs = [(nope * sc_full).astype(jnp.bfloat16), bufs[1][slot].astype(jnp.bfloat16)]
        else:
            kvs = [bufs[0][slot].astype(jnp.bfloat16)]
        logits = None
        for q_ref, kv in zip(q_refs, kvs):
            part = jax.lax.dot_general(q_ref[...].astype(jnp.bfloat16), kv, (((1,), (1,)), ((), ())),
                                       preferred_element_type=jnp.float32)
            logits = part if logits is None else logits + part
        logits = jnp.where(mask, logits * scale, NEG_INF)  # [Hp, bk]
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
    widths = [qp.shape[-1] for qp in q_parts]

    q_spec = lambda w: pl.BlockSpec((None, hp, w), lambda i, j, *_: (i, 0, 0))
    in_specs = [q_spec(w) for w in widths] + [pl.BlockSpec((hp, 1), lambda i, j, *_: (0, 0))]
    in_specs += [pl.BlockSpec(memory_space=pl.ANY)] * len(pool_args)
    out_specs = [q_spec(w) for w in widths] + [pl.BlockSpec((None, hp, 1), lambda i, j, *_: (i, 0, 0))]
    out_shape = [jax.ShapeDtypeStruct((bt, hp, w), out_dtype) for w in widths]
    out_shape.append(jax.ShapeDtypeStruct((bt, hp, 1), jnp.float32))
    slots = 2 if double_buffer else 1
    if fp8:
        bufs = [pltpu.VMEM((slots, block_k, NOPE_DIM), jnp.float8_e4m3fn),
                pltpu.VMEM((slots, block_k, ROPE_DIM), jnp.bfloat16), pltpu.VMEM((slots, block_k, 8), jnp.uint8)]
    else:
        bufs = [pltpu.VMEM((slots, block_k, d), window_kv.dtype)]
    scratch = bufs + [pltpu.VMEM((hp, 1), jnp.float32), pltpu.VMEM((hp, 1), jnp.float32)]
    scratch += [pltpu.VMEM((hp, w), jnp.float32) for w in widths] + [pltpu.SemaphoreType.DMA((slots,))]

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(scalars), grid=(bt, n_blocks), in_specs=in_specs, out_specs=out_specs,
        scratch_shapes=scratch)
    kernel = functools.partial(_kernel, srcs=[dict(k=s.k, n_rows=s.n_rows) for s in srcs], block_k=block_k,
                               scale=float(scale), fp8=fp8, n_q=len(q_parts), double_buffer=bool(double_buffer))
    outs = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=out_shape,
        interpret=pltpu.InterpretParams() if interpret else False,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        name="sparse_attention_tpu",
    )(*scalars, *q_parts, sk[:, None], *pool_args)
    o = outs[0] if len(widths) == 1 else jnp.concatenate(outs[:-1], axis=-1)
    lse = outs[-1][..., 0]
    o = o[:, :h].reshape(b, t, h, d)
    lse = lse[:, :h].reshape(b, t, h)
    return (o, lse) if return_lse else o
