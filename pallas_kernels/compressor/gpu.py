"""GPU Pallas (Triton backend) fused compressor chunk kernel: the contract is `reference.compress_chunk`.

Window grid. Batch row b lays its open-window state and the chunk on a grid of windows (window k = grid slots
k*r .. k*r + r - 1; slot g holds chunk token g - start % r if that is in [0, n_valid), else open-window state slot g
if g < start % r, else 0). Entry dest = start // r + k is written for every complete window k with dest < cap.

Program layout. The windows are cut into blocks of `wb` (`windows_per_block`) consecutive windows. A program owns
(batch row b, window block blk[, channel chunk]) and streams tiles of the block's rows: a tile is [wb * sb, dc]
(`sb` = `slot_block` slots of each of its wb windows, `dc` channels), tile row t <-> window blk * wb + t // sb,
slot s * sb + t % sb of slot sub-block s. Per-row masks pick chunk / open-window state / 0 (two masked loads).
An overlapping compressor (c = 2) pools 2r slots per window: the B-half is the window's own rows at channels
[d, 2d), the A-half the previous window's rows at channels [0, d) -- the same tile shifted by one window, taken
from the previous-window state (prev_kv / prev_gate) for window 0 (a third masked load).
Pooling is channel-wise: a tile is reshaped to [wb, sb, dc] and reduced over axis 1; with r / sb > 1 sub-blocks
the slots are walked in a `fori_loop` with a running max / sum (online softmax; Triton pipelines the loads with
num_stages). The pooled [wb, dc] chunk is rounded to `norm_dtype`.

Two layouts (`two_pass`):
  * fused, grid (B, n_blocks): one program pools all d / dc channel chunks of its windows (kept in registers), then
    finishes them. Small ratio, small d.
  * two-pass: pass 1, grid (B, n_blocks, d / dc), pools one channel chunk into a scratch [B, n_blocks * wb, d];
    pass 2, grid (B, n_blocks), finishes. More programs / fewer live registers, for few long windows (ratio 128)
    and wide rows (d = 512), at the cost of a scratch round trip. The scratch is in `norm_dtype` when that is
    narrower than float32 (the pooled values are rounded to it anyway, so this is exact): 4 bytes per pooled
    channel with bf16 instead of 8 (`scratch_dtype` overrides, e.g. float32 for the comparison).
Finishing a [wb, d] block of pooled rows (as [wb, dc] chunks): per-window RMS statistic [wb, 1] over all chunks,
weight, round; RoPE of the trailing rd channels at the window positions [wb, 1] (pair partners (2i, 2i+1) by a
reshape to [wb, dc/2, 2] + split / join: exact); the optional Hadamard rotation (`mix`: "butterfly" = the same
butterflies in the same order as `formats.hadamard`, so bitwise its float32 result -- split / join / transpose
within chunks, elementwise across chunks; "dot" = y @ H^T with `plgpu.dot` in IEEE float32); encoding; masked
stores of the block's rows at rows dest (rows of incomplete windows or dest >= cap are masked and sent out of
range; `input_output_aliases`: cache rows that no window writes are never touched).

Open-window state (`fuse_state`, default on): the new state_kv / state_gate are window k_open's rows
(k_open = (start % r + n_valid) // r) and the new prev_kv / prev_gate its A-half (the old prev state when
k_open = 0); the program(s) whose block holds k_open copy them into fresh outputs (every element written once;
the rows were just loaded, so mostly L1/L2 hits). `fuse_state=False` uses the XLA epilogue `next_state` instead.

Invariants: every in-kernel array shape is a power of two (wb, sb, dc; sb must divide r); loads and stores use
index arrays ([n, 1] rows x [1, m] columns) with masks, never array and slice indexers mixed; row b reads only row
b; nothing is stored for incomplete windows or dest >= cap; no Python control flow on traced values (fori_loop,
pl.when). Results equal the reference's up to float32 summation order in the pooling and the RMS statistic.
Options (None: `default_config(B, S, ratio, d, overlap, key_format)`): windows_per_block, slot_block, two_pass, dc, fuse_state, mix,
num_warps, num_stages, finish_num_warps.

Formats (`key_format`): None -> cast to the cache dtype; "bf16"; "fp8" (indexer 132 B: e4m3 + f32 pow2 scale per
row); "fp4" (indexer 68 B: packed e2m1 low-nibble-first + 4 ue8m0 scales); "kv_fp8" (the main KV cache's 584-B
rows of sparse_attention.fp8_layout). Rounding rules are `formats.quantize`'s / `quantize_kv_fp8`'s.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

try:
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover
    plgpu = None

from ..indexer import formats
from ..sparse_attention.fp8_layout import NOPE_DIM as FP8_NOPE, ROPE_DIM as FP8_ROPE, Fp8KVPool
from ..sparse_attention.fp8_layout import block_exponent as fp8_block_exponent


# ----------------------------------------------------------------------------------------------------------------
# shared helpers (also used by the TPU kernel)

def n_windows_of(S: int, r: int) -> int:
    return (r - 1 + S) // r + 1


def next_state(kv, gate, start, n_valid, state_kv, state_gate, prev_kv, prev_gate, *, ratio, overlap):
    """The reference's new (state_kv, state_gate, prev_kv, prev_gate): window k_open of the row's grid (and the
    A-half of window k_open - 1), gathered from the chunk / old state. Only <= 2 * ratio rows per batch row."""
    r = ratio
    B, S, cd = kv.shape
    d = cd // 2 if overlap else cd
    off = start % r
    k_open = (off + n_valid) // r

    def window(k):  # [B] window index -> ([B, r, cd] kv, gate) as the reference's `fill`
        g = k[:, None] * r + jnp.arange(r, dtype=jnp.int32)[None, :]
        j = g - off[:, None]
        from_chunk = ((j >= 0) & (j < n_valid[:, None]))[..., None]
        from_state = (g < off[:, None])[..., None]
        jc = jnp.clip(j, 0, S - 1)[..., None]
        gs = jnp.clip(g, 0, r - 1)[..., None]
        f = lambda c, s: jnp.where(from_chunk, jnp.take_along_axis(c, jc, axis=1),
                                   jnp.where(from_state, jnp.take_along_axis(s, gs, axis=1), 0.0))
        return f(kv, state_kv), f(gate, state_gate)

    skv, sgate = window(k_open)
    if overlap:
        has_prev = (k_open >= 1)[:, None, None]
        pkv, pgate = window(jnp.maximum(k_open - 1, 0))
        prev_kv = jnp.where(has_prev, pkv[..., :d], prev_kv)
        prev_gate = jnp.where(has_prev, pgate[..., :d], prev_gate)
    return skv, sgate, prev_kv, prev_gate


def entry_parts(entries, key_format):
    """Flatten the cache pytree into the arrays the kernel writes, validating against key_format."""
    if key_format == "kv_fp8":
        if not isinstance(entries, Fp8KVPool):
            raise ValueError("key_format 'kv_fp8' needs Fp8KVPool entries")
        return (entries.nope, entries.rope, entries.scale)
    if key_format in (None, "bf16"):
        if isinstance(entries, formats.QuantizedKeys):
            raise ValueError(f"key_format {key_format!r} needs an array cache, got QuantizedKeys")
        return (entries,)
    if not isinstance(entries, formats.QuantizedKeys) or entries.fmt != key_format:
        raise ValueError(f"key_format {key_format!r} needs QuantizedKeys({key_format!r}) entries")
    return (entries.values, entries.scale)


def entries_from_parts(outs, key_format):
    """The inverse of `entry_parts`: the arrays a kernel wrote -> the cache pytree of key_format."""
    if key_format in (None, "bf16"):
        return outs[0]
    if key_format == "kv_fp8":
        return Fp8KVPool(*outs)
    return formats.QuantizedKeys(outs[0], outs[1], key_format)


def mix_matrix(d: int, rotate: bool):
    """M = H_d / sqrt(d) (Sylvester-Hadamard) or the identity, float32 [d, d] numpy."""
    if rotate:
        h = np.ones((1, 1), np.float32)
        while h.shape[0] < d:
            h = np.block([[h, h], [h, -h]])
        m = h * np.float32(d ** -0.5)
    else:
        m = np.eye(d, dtype=np.float32)
    return m


def pow2_exponent(amax, fmt_max, floor):
    """ceil(log2(max(amax, floor) / fmt_max)) via the f32 bit pattern (normal numbers), as formats._pow2_exponent."""
    ratio = jnp.maximum(amax, floor) / fmt_max
    bits = jax.lax.bitcast_convert_type(ratio, jnp.int32)
    e = ((bits >> 23) & 0xFF) - 127
    return jnp.where((bits & 0x7FFFFF) != 0, e + 1, e)


def exp2i(e):
    """2^e as float32 for integer e in [-126, 127] (int32 array)."""
    return jax.lax.bitcast_convert_type((e + 127) << 23, jnp.float32)


def e2m1_code(v):
    """float32 (|v| <= 6) -> e2m1 code (uint8 nibble in int32) with round-to-nearest-even, sign bit 8."""
    a = jnp.abs(v)
    c = ((a > 0.25).astype(jnp.int32) + (a >= 0.75).astype(jnp.int32) + (a > 1.25).astype(jnp.int32)
         + (a >= 1.75).astype(jnp.int32) + (a > 2.5).astype(jnp.int32) + (a >= 3.5).astype(jnp.int32)
         + (a > 5.0).astype(jnp.int32))
    neg = jax.lax.bitcast_convert_type(v, jnp.int32) < 0
    return jnp.where(neg, c + 8, c)




# ----------------------------------------------------------------------------------------------------------------
# configuration

def _pow2_ceil(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _pow2_divisor(n: int) -> int:
    """Largest power of two dividing n."""
    return n & -n


def _default_warps(elems: int) -> int:
    """8 warps for >= 8192 live elements per tile (<= ~32 float32 per thread and tile), else 4."""
    return 8 if elems >= 8192 else 4


def _warps_for(cfg: dict, d: int, overlap: bool) -> tuple:
    """(pass-1 / fused num_warps, finish num_warps) from the block sizes: the pooling tiles are
    [wb * slot_block, dc] (x2 for the two halves of an overlapping compressor), the finish holds [wb, d]."""
    wb = cfg["windows_per_block"]
    pool = wb * cfg["slot_block"] * cfg["dc"] * (2 if overlap else 1)
    finish = _default_warps((cfg.get("finish_windows_per_block") or wb) * d)
    return (_default_warps(pool) if cfg["two_pass"] else max(_default_warps(pool), finish)), finish


def default_config(B: int, S: int, ratio: int, d: int, overlap: Optional[bool] = None,
                   key_format: Optional[str] = None) -> dict:
    """Kernel options for a [B, S] chunk of a ratio-`ratio` compressor with d output channels (overlap: the
    ratio-4 compressor's two halves; default ratio == 4) writing `key_format` entries.

    Small ratio: decode-sized chunks (<= 4 windows per row) take all windows of a row in one fused block; prefill
    takes the two-pass layout with 8-window blocks and 32-channel chunks (64 for the FP8 KV rows, whose scale blocks
    are 64 wide). H200, B=4 x S=16384 (session 11, results/h200_s11r3_compv.log): main CSA 179.6 us = 80% of HBM
    bandwidth (was 240.0, 60%: two-pass, 16 windows, 64 channels), indexer fp4 / fp8 61.8 / 60.2 us = 57% / 59%
    (was 97, 36%: fused, 8 windows); session 15, with the pass-1 scratch in bf16 and 10 calls per scan
    iteration (results/h200_s15r6_comp_unroll10.log): main CSA 179.5 us (81%), HCA 85.2 (84%), indexer fp4 / fp8
    58.8 / 57.9 us (61% / 62%; by CUPTI pool 43 us at 82% of copy bandwidth + finish 10-11 us). Pass 2 with its
    own larger window blocks was slower (finish_windows_per_block 32 / 64: 14-17 us). Large ratio: two-pass, one window per block, the slots walked
    in 16-row (prefill) / 32-row (decode) sub-blocks (online softmax, loads pipelined over 2 stages); at decode the
    new state comes from the XLA epilogue (fuse_state=False), which measured faster there.
    num_warps / finish_num_warps: `_warps_for` (compress_chunk_gpu recomputes them from the effective block sizes
    unless given)."""
    if overlap is None:
        overlap = ratio == 4
    nw = n_windows_of(S, ratio)
    dc = 64 if d % 64 == 0 else _pow2_divisor(d)
    if ratio <= 16:
        sb = _pow2_divisor(ratio)
        if nw <= 4:
            cfg = dict(windows_per_block=_pow2_ceil(nw), two_pass=False)
        else:
            cfg = dict(windows_per_block=8, two_pass=True)
            if key_format != "kv_fp8" and d % 32 == 0:
                dc = 32
        num_stages = 1
    else:  # H200 variants (results/h200_s3r3_compv.log, hca B=1 S=8192 / B=64 S=1): 16-slot sub-blocks 31 vs
        # 39-41 us for prefill; decode with the state update left to the XLA epilogue 34.5 vs 44.9 us
        sb = min(16 if S > 1 else 32, _pow2_divisor(ratio))
        cfg = dict(windows_per_block=1, two_pass=True)
        num_stages = 2
    fuse_state = ratio <= 16 or S > 1
    cfg.update(slot_block=sb, dc=dc, num_stages=num_stages, fuse_state=fuse_state, mix="butterfly")
    cfg["num_warps"], cfg["finish_num_warps"] = _warps_for(cfg, d, overlap)
    return cfg


@dataclasses.dataclass(frozen=True)
class _Static:
    """Compile-time parameters shared by the kernels."""
    r: int
    S: int
    d: int
    dc: int
    wb: int
    sb: int
    overlap: bool
    rd: int
    eps: float
    norm_dtype: Any
    key_format: Optional[str]
    rotate: bool
    cap: int
    n_parts: int
    fuse_state: bool
    mix: str

    @property
    def n_chunks(self):
        return self.d // self.dc


# ----------------------------------------------------------------------------------------------------------------
# kernels

def _iota(shape, dim):
    return jax.lax.broadcasted_iota(jnp.int32, shape, dim)


def _round(x, dtype):
    return x.astype(dtype).astype(jnp.float32)


def _pair_swap(x):
    """[n, w] -> x with channels 2i and 2i + 1 exchanged (a split / join: exact)."""
    n, w = x.shape
    ev, od = jax.lax.unstack(x.reshape(n, w // 2, 2), axis=2)
    return jax.lax.stack([od, ev], axis=2).reshape(n, w)


def _even_odd(x):
    """[n, w] -> ([n, w/2] even channels, [n, w/2] odd channels)."""
    n, w = x.shape
    return jax.lax.unstack(x.reshape(n, w // 2, 2), axis=2)


def _store(ref, b, rows, col0, val, ok):
    """ref[b, rows[i], col0 + j] = val[i, j] where ok[i] (rows [n, 1] int32, distinct where ok).

    Rows with ok False are sent out of range (row ref.shape[1]): the GPU never touches them, and the interpreter,
    whose masked store writes the old values back, drops them instead of racing a real row with the same index."""
    cols = col0 + _iota((1, val.shape[1]), 1)
    rows = jnp.where(ok, rows, ref.shape[1])
    plgpu.store(ref.at[b, rows, cols], val.astype(ref.dtype), mask=jnp.broadcast_to(ok, val.shape))


class _Rows:
    """Masked row loads of batch row b's window grid (chunk token / open-window state / previous-window state)."""

    def __init__(self, st: _Static, b, start, nv, ins):
        self.st, self.b, self.nv = st, b, nv
        self.off = start % st.r
        self.kv_ref, self.gate_ref, self.skv_ref, self.sg_ref, self.pkv_ref, self.pg_ref = ins

    def grid(self, which, g, col0):
        """[n, dc] grid slots g [n, 1] of kv (which = 0) or gate (1) at channels col0 + [0, dc)."""
        st, b = self.st, self.b
        cref, sref = ((self.kv_ref, self.skv_ref), (self.gate_ref, self.sg_ref))[which]
        shape = (g.shape[0], st.dc)
        cols = col0 + _iota((1, st.dc), 1)
        j = g - self.off
        m_c = jnp.broadcast_to((j >= 0) & (j < self.nv), shape)
        m_s = jnp.broadcast_to((g >= 0) & (g < self.off), shape)
        x = plgpu.load(cref.at[b, jnp.clip(j, 0, st.S - 1), cols], mask=m_c, other=0.0)
        y = plgpu.load(sref.at[b, jnp.clip(g, 0, st.r - 1), cols], mask=m_s, other=0.0)
        return jnp.where(m_c, x, y)

    def a_half(self, which, g, col0):
        """A-half rows of the windows of slots g: grid slots g - r at channels col0, or the previous-window state
        (slot g) where g - r < 0."""
        st = self.st
        pref = (self.pkv_ref, self.pg_ref)[which]
        first = jnp.broadcast_to(g < st.r, (g.shape[0], st.dc))
        p = plgpu.load(pref.at[self.b, jnp.clip(g, 0, st.r - 1), col0 + _iota((1, st.dc), 1)], mask=first, other=0.0)
        return jnp.where(first, p, self.grid(which, g - st.r, col0))


def _pool_chunk(st: _Static, rows: _Rows, blk, c0):
    """Pooled [wb, dc] float32 (rounded to norm_dtype) of windows blk * wb + [0, wb) at channels c0 + [0, dc)."""
    r, d, dc, wb, sb = st.r, st.d, st.dc, st.wb, st.sb
    c0_b = (d if st.overlap else 0) + c0               # channels of a window's own (B) rows; A rows: c0
    t = _iota((wb * sb, 1), 0)

    def body(s, carry):
        m, num, den = carry
        g = (blk * wb + t // sb) * r + s * sb + t % sb  # [R, 1] grid slot of each tile row
        tiles = []
        if st.overlap:                                 # A-half first (the reference's slot order)
            tiles.append((rows.a_half(0, g, c0), rows.a_half(1, g, c0)))
        tiles.append((rows.grid(0, g, c0_b), rows.grid(1, g, c0_b)))
        tiles = [(x.reshape(wb, sb, dc), y.reshape(wb, sb, dc)) for x, y in tiles]
        m_new = m
        for _, y in tiles:
            m_new = jnp.maximum(m_new, jnp.max(y, axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # all slots so far -inf (fresh prev state)
        alpha = jnp.exp(m - m_safe)
        num, den = num * alpha, den * alpha
        for x, y in tiles:
            e = jnp.exp(y - m_safe[:, None, :])
            num = num + jnp.sum(e * x, axis=1)
            den = den + jnp.sum(e, axis=1)
        return m_new, num, den

    init = (jnp.full((wb, dc), -jnp.inf, jnp.float32), jnp.zeros((wb, dc), jnp.float32),
            jnp.zeros((wb, dc), jnp.float32))
    n_sub = r // sb
    if n_sub == 1:
        _, num, den = body(0, init)
    else:
        _, num, den = jax.lax.fori_loop(0, n_sub, body, init)
    return _round(num / den, st.norm_dtype)


def _copy_state(st: _Static, rows: _Rows, blk, nv, state_outs, c0=None):
    """The new open-window state at channels c0 + [0, dc) (and d + c0 + [0, dc) of an overlapping compressor;
    c0 None: every chunk): window k_open's rows -> state, window k_open's A-half -> prev state. Done by the program
    whose window block holds k_open."""
    r, d, dc, sb = st.r, st.d, st.dc, st.sb
    k_open = (rows.off + nv) // r
    b = rows.b
    ts = _iota((sb, 1), 0)
    every = jnp.ones((sb, 1), jnp.bool_)

    def copy(c0, s):
        slot = s * sb + ts
        g = k_open * r + slot
        if st.overlap:
            _store(state_outs[0], b, slot, d + c0, rows.grid(0, g, d + c0), every)
            _store(state_outs[1], b, slot, d + c0, rows.grid(1, g, d + c0), every)
            _store(state_outs[2], b, slot, c0, rows.a_half(0, g, c0), every)
            _store(state_outs[3], b, slot, c0, rows.a_half(1, g, c0), every)
        _store(state_outs[0], b, slot, c0, rows.grid(0, g, c0), every)
        _store(state_outs[1], b, slot, c0, rows.grid(1, g, c0), every)

    n_sub = r // sb

    def copy_chunk(c0):
        if n_sub == 1:
            copy(c0, 0)
        else:
            jax.lax.fori_loop(0, n_sub, lambda s, carry: (copy(c0, s), carry)[1], 0)

    @pl.when((k_open >= blk * st.wb) & (k_open < blk * st.wb + st.wb))
    def _():
        if c0 is not None:
            copy_chunk(c0)
        else:
            jax.lax.fori_loop(0, st.n_chunks, lambda c, carry: (copy_chunk(c * dc), carry)[1], 0)


def _butterfly(x, h):
    """One Walsh-Hadamard stage within [n, w] rows: (x[i], x[i + h]) -> (x[i] + x[i + h], x[i] - x[i + h]) for
    i & h == 0 (h < w), as a split / join on a trailing axis of size 2."""
    n, w = x.shape
    if h == 1:
        a, bb = jax.lax.unstack(x.reshape(n, w // 2, 2), axis=2)
        return jax.lax.stack([a + bb, a - bb], axis=2).reshape(n, w)
    y = jnp.transpose(x.reshape(n, w // (2 * h), 2, h), (0, 1, 3, 2))
    a, bb = jax.lax.unstack(y, axis=3)
    y = jax.lax.stack([a + bb, a - bb], axis=3)
    return jnp.transpose(y, (0, 1, 3, 2)).reshape(n, w)


def _hadamard(ys, d):
    """Orthonormal Walsh-Hadamard transform of rows given as [n, dc] chunks: the same butterflies, in the same
    order, as `formats.hadamard` (so the same float32 result)."""
    dc = ys[0].shape[1]
    ys = list(ys)
    h = 1
    while h < d:
        if h < dc:
            ys = [_butterfly(y, h) for y in ys]
        else:
            hc = h // dc
            for c in range(len(ys)):
                if c & hc == 0:
                    ys[c], ys[c + hc] = ys[c] + ys[c + hc], ys[c] - ys[c + hc]
        h *= 2
    return [y * (d ** -0.5) for y in ys]


def _finish(st: _Static, b, blk, start, nv, pooled, nw_ref, fq_ref, m_ref, outs):
    """pooled: d / dc chunks [wb, dc] of windows blk * wb + [0, wb) -> RMS norm, RoPE, mix, encode, store."""
    r, d, dc, wb, rd = st.r, st.d, st.dc, st.wb, st.rd
    nc = st.n_chunks
    wi = blk * wb + _iota((wb, 1), 0)
    off = start % r
    win_pos = start - off + wi * r                     # [wb, 1]
    dest = win_pos // r
    ok = (win_pos + r <= start + nv) & (dest < st.cap)

    tot = jnp.sum(pooled[0] * pooled[0], axis=1, keepdims=True)
    for p in pooled[1:]:
        tot = tot + jnp.sum(p * p, axis=1, keepdims=True)
    inv = jax.lax.rsqrt(tot / d + st.eps)
    ys = [_round(pooled[c] * inv * nw_ref[pl.ds(c * dc, dc)][None, :], st.norm_dtype) for c in range(nc)]

    col = _iota((1, dc), 1)
    posf = win_pos.astype(jnp.float32)
    sign = jnp.where((col & 1) == 0, -1.0, 1.0)
    for c in range(nc):                                # RoPE chunks (rd % dc == 0 and (d - rd) % dc == 0)
        if (c + 1) * dc <= d - rd:
            continue
        ang = posf * fq_ref[pl.ds(c * dc - (d - rd), dc)][None, :]
        ys[c] = _round(ys[c] * jnp.cos(ang) + sign * _pair_swap(ys[c]) * jnp.sin(ang), st.norm_dtype)

    def mixed():
        """Hadamard rotation: butterflies ("butterfly", bitwise the reference's) or z = y @ M^T ("dot", M^T
        passed, float32 IEEE products), in [wb, dc] chunks."""
        if st.mix == "butterfly":
            return _hadamard(ys, d)
        zs = []
        for i in range(nc):
            acc = None
            for c in range(nc):
                p = plgpu.dot(ys[c], m_ref[pl.ds(c * dc, dc), pl.ds(i * dc, dc)], allow_tf32=False)
                acc = p if acc is None else acc + p
            zs.append(acc)
        return zs

    zs = mixed() if st.rotate else ys
    fmt = st.key_format
    if fmt in (None, "bf16"):
        (o_ref,) = outs
        for c in range(nc):
            _store(o_ref, b, dest, c * dc, zs[c], ok)
    elif fmt == "kv_fp8":  # 448 e4m3 in 64-wide blocks with ue8m0 scales, 64 bf16 rope, 1 pad byte
        nope_ref, rope_ref, sc_ref = outs
        col8 = _iota((1, sc_ref.shape[-1]), 1)
        sc = jnp.full((wb, sc_ref.shape[-1]), 127, jnp.int32)
        for c in range(nc):
            z = _round(zs[c], jnp.bfloat16)            # the reference rounds rows through bf16
            if c * dc >= FP8_NOPE:
                _store(rope_ref, b, dest, c * dc - FP8_NOPE, z, ok)
                continue
            amax = jnp.max(jnp.abs(z), axis=1, keepdims=True)
            e = fp8_block_exponent(amax)
            _store(nope_ref, b, dest, c * dc, z / exp2i(e), ok)
            sc = jnp.where(col8 == c, e + 127, sc)
        _store(sc_ref, b, dest, 0, sc, ok)
    elif fmt == "fp8":
        v_ref, s_ref = outs
        amax = jnp.max(jnp.abs(zs[0]), axis=1, keepdims=True)
        for z in zs[1:]:
            amax = jnp.maximum(amax, jnp.max(jnp.abs(z), axis=1, keepdims=True))
        s = exp2i(pow2_exponent(amax, formats.E4M3_MAX, formats.E4M3_AMAX_FLOOR))     # [wb, 1]
        for c in range(nc):
            _store(v_ref, b, dest, c * dc, zs[c] / s, ok)
        _store(s_ref, b, dest, 0, s, ok)
    else:  # fp4: byte j = code(z[2j]) | code(z[2j + 1]) << 4, one ue8m0 scale per 32 channels (16 bytes)
        v_ref, s_ref = outs
        half, hb = dc // 2, formats.FP4_BLOCK // 2
        nsb = dc // formats.FP4_BLOCK
        for c in range(nc):
            ze, zo = _even_odd(zs[c])                  # [wb, dc/2]
            a_abs = jnp.maximum(jnp.abs(ze), jnp.abs(zo)).reshape(wb, nsb, hb)
            amax = jnp.max(a_abs, axis=2)              # [wb, dc/32]
            e = jnp.clip(pow2_exponent(amax, formats.E2M1_MAX, formats.E2M1_AMAX_FLOOR), -126, 127)
            scale = jnp.broadcast_to(exp2i(e)[:, :, None], (wb, nsb, hb)).reshape(wb, half)
            byte = e2m1_code(ze / scale) | (e2m1_code(zo / scale) << 4)
            _store(v_ref, b, dest, c * half, byte, ok)
            _store(s_ref, b, dest, c * nsb, e + 127, ok)


def _pool_kernel(*refs, st: _Static, two_pass: bool):
    """Fused layout (grid (B, n_blocks)): pool every chunk, finish. Two-pass pass 1 (grid (B, n_blocks, d/dc)):
    pool chunk program_id(2) into the scratch."""
    it = iter(refs)
    start_ref, nv_ref, kv_ref, gate_ref, skv_ref, sg_ref = (next(it) for _ in range(6))
    pkv_ref, pg_ref = (next(it), next(it)) if st.overlap else (None, None)
    if not two_pass:
        nw_ref, fq_ref = next(it), next(it)
        m_ref = next(it) if st.rotate and st.mix == "dot" else None
        for _ in range(st.n_parts):                    # the aliased cache inputs (never read)
            next(it)
        outs = [next(it) for _ in range(st.n_parts)]
    else:
        scr_ref = next(it)
    state_outs = list(it)
    b, blk = pl.program_id(0), pl.program_id(1)
    start, nv = start_ref[b], nv_ref[b]
    rows = _Rows(st, b, start, nv, (kv_ref, gate_ref, skv_ref, sg_ref, pkv_ref, pg_ref))
    if two_pass:
        c0 = pl.program_id(2) * st.dc
        p = _pool_chunk(st, rows, blk, c0)
        _store(scr_ref, b, blk * st.wb + _iota((st.wb, 1), 0), c0, p, jnp.ones((st.wb, 1), jnp.bool_))
        if st.fuse_state:
            _copy_state(st, rows, blk, nv, state_outs, c0)
        return
    pooled = [_pool_chunk(st, rows, blk, c * st.dc) for c in range(st.n_chunks)]
    if st.fuse_state:
        _copy_state(st, rows, blk, nv, state_outs)
    _finish(st, b, blk, start, nv, pooled, nw_ref, fq_ref, m_ref, outs)


def _finish_kernel(*refs, st: _Static):
    """Two-pass pass 2 (grid (B, n_blocks)): finish the scratch rows of a window block."""
    it = iter(refs)
    start_ref, nv_ref, scr_ref, nw_ref, fq_ref = (next(it) for _ in range(5))
    m_ref = next(it) if st.rotate and st.mix == "dot" else None
    rest = list(it)
    outs = rest[st.n_parts:]
    b, blk = pl.program_id(0), pl.program_id(1)
    rows = blk * st.wb + _iota((st.wb, 1), 0)
    pooled = [plgpu.load(scr_ref.at[b, rows, c * st.dc + _iota((1, st.dc), 1)]).astype(jnp.float32)
              for c in range(st.n_chunks)]
    _finish(st, b, blk, start_ref[b], nv_ref[b], pooled, nw_ref, fq_ref, m_ref, outs)


def compress_chunk_gpu(kv, gate, start, n_valid, state_kv, state_gate, prev_kv, prev_gate, entries, *, ratio: int,
                       overlap: bool, norm_weight, eps: float, inv_freq, norm_dtype=jnp.float32,
                       key_format: Optional[str] = None, rotate: bool = False, interpret: bool = False,
                       windows_per_block: Optional[int] = None, slot_block: Optional[int] = None,
                       two_pass: Optional[bool] = None, dc: Optional[int] = None, fuse_state: Optional[bool] = None,
                       mix: Optional[str] = None, num_warps: Optional[int] = None,
                       num_stages: Optional[int] = None, finish_num_warps: Optional[int] = None,
                       scratch_dtype: Any = None, finish_windows_per_block: Optional[int] = None,
                       finish_dc: Optional[int] = None):
    """Pallas GPU implementation of `reference.compress_chunk` with the encoding given explicitly:
    key_format None (cast to the cache dtype) | "bf16" | "fp8" | "fp4" | "kv_fp8", `rotate` = Hadamard first.
    Kernel options (None: `default_config`): windows_per_block, slot_block (powers of two, slot_block | ratio),
    two_pass, dc (channel chunk), fuse_state, mix ("butterfly" | "dot"), num_warps (pass 1 / fused kernel),
    num_stages, finish_num_warps (two-pass pass 2); unset warps follow the effective block sizes (`_warps_for`);
    scratch_dtype (two-pass; None = norm_dtype if narrower than float32, else float32; a dtype narrower than
    norm_dtype is refused: it would round the pooled values a second time); finish_windows_per_block /
    finish_dc (two-pass pass 2's own window block and channel chunk, powers of two; None = pass 1's: the scratch is
    row-major, so pass 2 may cut it differently).
    Returns (entries, state_kv, state_gate, prev_kv, prev_gate)."""
    r = ratio
    B, S, cd = kv.shape
    d = cd // 2 if overlap else cd
    inv_freq = np.asarray(inv_freq, np.float32)
    rd = 2 * inv_freq.shape[0]
    cfg = default_config(B, S, r, d, overlap, key_format)
    if dc is None:   # the rope channels must be whole chunks
        while cfg["dc"] > 2 and (rd % cfg["dc"] or (d - rd) % cfg["dc"]):
            cfg["dc"] //= 2
    opt = dict(windows_per_block=windows_per_block, slot_block=slot_block, two_pass=two_pass, dc=dc,
               fuse_state=fuse_state, mix=mix, num_stages=num_stages,
               finish_windows_per_block=finish_windows_per_block, finish_dc=finish_dc)
    cfg.update({k: v for k, v in opt.items() if v is not None})
    w1, w2 = _warps_for(cfg, d, overlap)
    cfg["num_warps"], cfg["finish_num_warps"] = num_warps or w1, finish_num_warps or w2
    wb, sb, dc = cfg["windows_per_block"], cfg["slot_block"], cfg["dc"]
    fwb, fdc = cfg.get("finish_windows_per_block") or wb, cfg.get("finish_dc") or dc
    for name, v in (("windows_per_block", wb), ("slot_block", sb), ("dc", dc), ("finish_windows_per_block", fwb),
                    ("finish_dc", fdc)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"{name} must be a power of two, got {v}")
    if (fwb, fdc) != (wb, dc) and not cfg["two_pass"]:
        raise ValueError("finish_windows_per_block / finish_dc apply to the two-pass layout (two_pass=True)")
    if r % sb:
        raise ValueError(f"slot_block {sb} must divide the ratio {r}")
    if cfg["mix"] not in ("butterfly", "dot"):
        raise ValueError(f"mix must be 'butterfly' or 'dot', got {cfg['mix']!r}")
    for name, v in (("channel chunk", dc), ("finish_dc", fdc)):
        if d % v or rd % v or (d - rd) % v or v % 2:
            raise ValueError(f"{name} {v} must divide d={d} and the rope width {rd} (rope channels whole chunks)")
    if key_format == "kv_fp8" and (d, rd, fdc) != (FP8_NOPE + FP8_ROPE, FP8_ROPE, 64):
        raise ValueError(f"kv_fp8 rows need d = {FP8_NOPE}+{FP8_ROPE} with {FP8_ROPE} rope dims and 64-wide chunks")
    if key_format == "fp4" and fdc % formats.FP4_BLOCK:
        raise ValueError("fp4 needs the channel chunk to be a multiple of 32")
    if rotate and d & (d - 1):
        raise ValueError(f"the Hadamard rotation needs a power-of-two width, got d={d}")
    if key_format == "kv_fp8" and rotate:
        raise ValueError("the FP8 KV rows are never rotated")
    parts = entry_parts(entries, key_format)
    cap = parts[0].shape[1]
    fuse = bool(cfg["fuse_state"])
    n_blocks = -(-n_windows_of(S, r) // wb)
    st = _Static(r=r, S=S, d=d, dc=dc, wb=wb, sb=sb, overlap=overlap, rd=rd, eps=float(eps),
                 norm_dtype=jnp.dtype(norm_dtype), key_format=key_format, rotate=rotate, cap=cap,
                 n_parts=len(parts), fuse_state=fuse, mix=cfg["mix"])
    start = start.astype(jnp.int32)
    n_valid = n_valid.astype(jnp.int32)
    kvf, gf = kv.astype(jnp.float32), gate.astype(jnp.float32)
    nw_arg = jnp.asarray(norm_weight, jnp.float32).reshape(d)
    fq_arg = jnp.asarray(np.repeat(inv_freq, 2))          # per channel of the rope range
    finish_args = [nw_arg, fq_arg] + ([jnp.asarray(mix_matrix(d, True).T)] if rotate and st.mix == "dot" else [])
    pool_args = [start, n_valid, kvf, gf, state_kv, state_gate] + ([prev_kv, prev_gate] if overlap else [])

    state_shape = []
    if fuse:
        sdt = jnp.result_type(kvf.dtype, state_kv.dtype)
        state_shape = [jax.ShapeDtypeStruct((B, r, cd), sdt)] * 2
        if overlap:
            state_shape += [jax.ShapeDtypeStruct((B, r, d), jnp.result_type(sdt, prev_kv.dtype))] * 2
    part_shape = [jax.ShapeDtypeStruct(p.shape, p.dtype) for p in parts]

    def call(kernel, grid, args, out_shape, aliases, name, warps):
        full = lambda s: pl.BlockSpec(s.shape, lambda *_: (0,) * len(s.shape))
        extra = {}
        if not interpret:
            extra["compiler_params"] = plgpu.CompilerParams(num_warps=warps, num_stages=cfg["num_stages"])
        return pl.pallas_call(
            kernel, grid=grid, in_specs=[full(a) for a in args], out_specs=[full(s) for s in out_shape],
            out_shape=out_shape, interpret=interpret, input_output_aliases=aliases, name=name, **extra)(*args)

    tag = f"r{r}_d{d}"
    nd = jnp.dtype(norm_dtype)
    scr_dt = jnp.dtype(scratch_dtype) if scratch_dtype is not None else (nd if nd.itemsize < 4 else jnp.dtype(
        jnp.float32))
    if scr_dt not in (jnp.dtype(jnp.float32), nd) or not jnp.issubdtype(scr_dt, jnp.floating):
        raise ValueError(f"scratch_dtype must be float32 or norm_dtype ({nd}), got {scr_dt}: the pooled values are "
                         f"rounded to norm_dtype, and any other dtype would round them again")
    if cfg["two_pass"]:
        # pass 2 cuts the windows into its own blocks of fwb: the scratch has rows for both cuts (rows past the
        # last window are never written by pass 1 and belong to incomplete windows, whose stores are masked)
        nb_f = -(-n_windows_of(S, r) // fwb)
        st_f = dataclasses.replace(st, wb=fwb, dc=fdc)
        scr_shape = jax.ShapeDtypeStruct((B, max(n_blocks * wb, nb_f * fwb), d), scr_dt)
        res = call(functools.partial(_pool_kernel, st=st, two_pass=True), (B, n_blocks, d // dc), pool_args,
                   [scr_shape] + state_shape, {}, f"compress_pool_{tag}", cfg["num_warps"])
        scr, state_new = res[0], res[1:]
        args = [start, n_valid, scr] + finish_args + list(parts)
        n_in = len(args) - len(parts)
        outs = call(functools.partial(_finish_kernel, st=st_f), (B, nb_f), args, part_shape,
                    {n_in + i: i for i in range(len(parts))}, f"compress_finish_{tag}", cfg["finish_num_warps"])
    else:
        args = pool_args + finish_args + list(parts)
        n_in = len(args) - len(parts)
        res = call(functools.partial(_pool_kernel, st=st, two_pass=False), (B, n_blocks), args,
                   part_shape + state_shape, {n_in + i: i for i in range(len(parts))}, f"compress_{tag}",
                   cfg["num_warps"])
        outs, state_new = res[:len(parts)], res[len(parts):]
    new_entries = entries_from_parts(outs, key_format)
    if fuse:
        skv, sg = state_new[0], state_new[1]
        pkv, pg = (state_new[2], state_new[3]) if overlap else (prev_kv, prev_gate)
    else:
        skv, sg, pkv, pg = next_state(kvf, gf, start, n_valid, state_kv, state_gate, prev_kv, prev_gate,
                                      ratio=r, overlap=overlap)
    return new_entries, skv, sg, pkv, pg
