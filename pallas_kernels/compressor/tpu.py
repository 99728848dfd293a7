"""TPU Pallas (Mosaic) fused compressor chunk kernel; the contract is `reference.compress_chunk`.

Windows in blocks (session 38). Up to session 37 a grid step pooled one window: it copied the window's `ratio`
chunk rows (and the previous window's, overlapping) by blocking DMAs, computed on a [1, d] row, and wrote the entry
by another blocking DMA. A 16K-token prefill at ratio 4 took 4096 such steps per row, each a few DMA latencies and
the per-step overhead, for a few KB of data. Now:
1. XLA lays each row's chunk and open-window state on its window grid: `reference.window_pools`, the slots every
   window pools (an overlapping compressor's 2r: the previous window's A-half, then its own B-half), as the
   reference does.
2. The kernel, grid (batch row b, block of `wb` windows), gets [wb, c * ratio, d] tiles of kv and gate through
   BlockSpecs (double-buffered by Pallas) and finishes the block's wb windows at once: the channel-wise softmax
   over the slots, rounding to `norm_dtype`, RMSNorm, RoPE at each window's position (pair partner via lane
   rolls), the optional Hadamard as a [wb, d] x [d, d] matmul (MXU, f32), and the encoding (cache dtype, indexer
   bf16 / fp8 / fp4, or the main KV cache's 584-B FP8 rows), all per row of the block.
3. The block's encoded rows go to a [B, n_blocks, wb, ...] output, and XLA scatters the complete windows into the
   cache at their entries (w < cap) and takes the new open-window state from the grid of step 1, with the
   reference's own functions (`write_complete_windows`, `open_window_state`).
wb = 8 windows for ratio < 128 (a block of 8 rows fills the sublanes), 1 window of 128 slots at ratio 128.

Status: validated in the TPU interpreter (`pltpu.InterpretParams`) on CPU, and Pallas' Mosaic lowering for a TPU
(v6e) target runs in CI (`tests/test_tpu_lowering.py`); libtpu compiles it for v6e / v5e topologies on a CPU host
(`benchmarks/tpu_offline.py`, session 50), but it has never run on a TPU, so the speed-up is designed, not measured.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ..indexer import formats
from ..numerics import round_to_bf16
from ..sparse_attention.fp8_layout import NOPE_DIM as FP8_NOPE, ROPE_DIM as FP8_ROPE
from ..sparse_attention.fp8_layout import block_exponent as fp8_block_exponent
from .gpu import e2m1_code, entries_from_parts, entry_parts, exp2i, mix_matrix, pow2_exponent
from .reference import open_window_state, window_pools, write_complete_windows


def _kernel(start_ref, kv_ref, gate_ref, nw_ref, freq_ref, *refs, r, wb, d, eps, norm_dtype, key_format, rotate,
            n_parts):
    """Block (b, i): windows i * wb .. i * wb + wb - 1 of row b's grid. kv_ref / gate_ref [wb, c * r, d] (the
    slots each window pools), nw_ref / freq_ref [1, d]; refs: the mix matrices (fp4: even / odd rows; rotate: one),
    then the outputs [wb, ...] per part of the cache format."""
    m_refs = list(refs[:-n_parts])
    outs = refs[-n_parts:]
    b = pl.program_id(0)
    i = pl.program_id(1)
    start = start_ref[b]
    g = gate_ref[...]
    m = jnp.max(g, axis=1, keepdims=True)                                  # [wb, 1, d]
    e = jnp.exp(g - m)
    p = jnp.sum(e * kv_ref[...], axis=1) / jnp.sum(e, axis=1)              # [wb, d] channel-wise softmax pool
    p = p.astype(norm_dtype).astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.sum(p * p, axis=1, keepdims=True) / d + eps)
    y = (p * inv * nw_ref[...]).astype(norm_dtype).astype(jnp.float32)
    # RoPE at each window's first grid position: partner of channel c is c ^ 1 (lane rolls); freq is 0 outside the
    # rope channels
    col = jax.lax.broadcasted_iota(jnp.int32, (wb, d), 1)
    even = (col & 1) == 0
    partner = jnp.where(even, pltpu.roll(y, d - 1, 1), pltpu.roll(y, 1, 1))
    win = i * wb + jax.lax.broadcasted_iota(jnp.int32, (wb, 1), 0)
    ang = (start - start % r + win * r).astype(jnp.float32) * freq_ref[...]
    rot = y * jnp.cos(ang) + jnp.where(even, -1.0, 1.0) * partner * jnp.sin(ang)
    y = jnp.where(freq_ref[...] != 0, rot.astype(norm_dtype).astype(jnp.float32), y)

    def mix(mref):
        return jax.lax.dot_general(y, mref[...], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                                   precision=jax.lax.Precision.HIGHEST)

    def block_max(x, groups, width):
        """Per row, the max of x over each run of `width` columns -> ([wb, groups] maxima, column -> group)."""
        grp = jax.lax.broadcasted_iota(jnp.int32, x.shape, 1) // width
        gcol = jax.lax.broadcasted_iota(jnp.int32, (x.shape[0], groups), 1)
        amax = jnp.zeros((x.shape[0], groups), jnp.float32)
        for c in range(groups):
            amax = jnp.where(gcol == c, jnp.max(jnp.where(grp == c, x, 0.0), axis=1, keepdims=True), amax)
        return amax, grp

    def spread(per_group, grp):
        """[wb, groups] -> [wb, columns]: each column takes its group's value."""
        out = jnp.zeros(grp.shape, per_group.dtype)
        for c in range(per_group.shape[1]):
            out = jnp.where(grp == c, per_group[:, c:c + 1], out)
        return out

    if key_format in (None, "bf16"):
        z = mix(m_refs[0]) if rotate else y
        outs[0][...] = z.astype(outs[0].dtype)
    elif key_format == "fp8":
        z = mix(m_refs[0]) if rotate else y
        sc = exp2i(pow2_exponent(jnp.max(jnp.abs(z), axis=1, keepdims=True), formats.E4M3_MAX, formats.E4M3_AMAX_FLOOR))
        outs[0][...] = (z / sc).astype(outs[0].dtype)
        outs[1][...] = sc
    elif key_format == "kv_fp8":  # 584-B rows: 7 x 64 e4m3 with ue8m0 scales, 64 bf16 rope, 1 pad scale byte
        z = round_to_bf16(y)                                                # the format rounds rows through bf16
        nb = FP8_NOPE // 64
        amax, grp = block_max(jnp.abs(z[:, :FP8_NOPE]), nb, 64)
        ex = fp8_block_exponent(amax)                                      # [wb, 7]
        outs[0][...] = (z[:, :FP8_NOPE] / spread(exp2i(ex), grp)).astype(outs[0].dtype)
        outs[1][...] = z[:, FP8_NOPE:].astype(outs[1].dtype)
        sbytes = jnp.full((wb, outs[2].shape[-1]), 127, jnp.int32)
        scol = jax.lax.broadcasted_iota(jnp.int32, sbytes.shape, 1)
        for c in range(nb):
            sbytes = jnp.where(scol == c, ex[:, c:c + 1] + 127, sbytes)
        outs[2][...] = sbytes.astype(outs[2].dtype)
    else:
        ze, zo = mix(m_refs[0]), mix(m_refs[1])                              # [wb, d/2] even / odd channels
        n_grp = d // formats.FP4_BLOCK
        amax, grp = block_max(jnp.maximum(jnp.abs(ze), jnp.abs(zo)), n_grp, formats.FP4_BLOCK // 2)
        ex = jnp.clip(pow2_exponent(amax, formats.E2M1_MAX, formats.E2M1_AMAX_FLOOR), -126, 127)
        sc = spread(exp2i(ex), grp)
        outs[0][...] = (e2m1_code(ze / sc) | (e2m1_code(zo / sc) << 4)).astype(outs[0].dtype)
        outs[1][...] = (ex + 127).astype(outs[1].dtype)


def compress_chunk_tpu(kv, gate, start, n_valid, state_kv, state_gate, prev_kv, prev_gate, entries, *, ratio: int,
                       overlap: bool, norm_weight, eps: float, inv_freq, norm_dtype=jnp.float32,
                       key_format: Optional[str] = None, rotate: bool = False, interpret: bool = False,
                       windows_per_block: Optional[int] = None):
    """Mosaic TPU implementation of `reference.compress_chunk` with explicit encoding (see `gpu.compress_chunk_gpu`).
    windows_per_block: windows a grid step finishes (default 8 below ratio 128, else 1)."""
    r = ratio
    B, S, cd = kv.shape
    d = cd // 2 if overlap else cd
    inv_freq = np.asarray(inv_freq, np.float32)
    rd = 2 * inv_freq.shape[0]
    parts = entry_parts(entries, key_format)
    if key_format == "kv_fp8" and (d != FP8_NOPE + FP8_ROPE or rd != FP8_ROPE or rotate):
        raise ValueError(f"kv_fp8 rows need d = {FP8_NOPE}+{FP8_ROPE} with {FP8_ROPE} rope dims and no rotation")
    wb = int(windows_per_block or (8 if r < 128 else 1))
    if wb < 1:
        raise ValueError(f"windows_per_block must be >= 1, got {wb}")
    start = start.astype(jnp.int32)
    n_valid = n_valid.astype(jnp.int32)
    kvf, gf = kv.astype(jnp.float32), gate.astype(jnp.float32)
    win_kv, win_gate, pool_kv, pool_gate = window_pools(kvf, gf, start, n_valid, state_kv, state_gate, prev_kv,
                                                        prev_gate, ratio=r, overlap=overlap)
    nw = pool_kv.shape[1]
    n_blk = -(-nw // wb)
    if n_blk * wb != nw:   # whole blocks; the padding windows are never complete, so never written
        pad = ((0, 0), (0, n_blk * wb - nw), (0, 0), (0, 0))
        pool_kv, pool_gate = jnp.pad(pool_kv, pad), jnp.pad(pool_gate, pad)
    slots = pool_kv.shape[2]
    freq_row = np.zeros((1, d), np.float32)
    freq_row[0, d - rd:] = np.repeat(inv_freq, 2)
    whole = lambda shape: pl.BlockSpec(shape, lambda b, i, *_: (0,) * len(shape))
    tile = pl.BlockSpec((None, wb, slots, d), lambda b, i, *_: (b, i, 0, 0))
    args = [pool_kv, pool_gate, jnp.asarray(norm_weight, jnp.float32).reshape(1, d), jnp.asarray(freq_row)]
    in_specs = [tile, tile, whole((1, d)), whole((1, d))]
    if key_format == "fp4" or rotate:
        m = mix_matrix(d, rotate)
        mats = [m[0::2], m[1::2]] if key_format == "fp4" else [m]
        args += [jnp.asarray(x) for x in mats]
        in_specs += [whole(x.shape) for x in mats]
    widths = [p.shape[2:] for p in parts]
    out_shape = [jax.ShapeDtypeStruct((B, n_blk, wb) + w, p.dtype) for w, p in zip(widths, parts)]
    out_specs = [pl.BlockSpec((None, None, wb) + w, lambda b, i, *_, n=len(w): (b, i, 0) + (0,) * n)
                 for w in widths]
    grid_spec = pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, grid=(B, n_blk), in_specs=in_specs,
                                             out_specs=out_specs)
    kernel = functools.partial(_kernel, r=r, wb=wb, d=d, eps=float(eps), norm_dtype=jnp.dtype(norm_dtype),
                               key_format=key_format, rotate=rotate, n_parts=len(parts))
    extra = dict(interpret=pltpu.InterpretParams()) if interpret else {}
    rows = pl.pallas_call(
        kernel, grid_spec=grid_spec, out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        name=f"compress_tpu_r{r}_d{d}", **extra,
    )(start, *args)
    encoded = entries_from_parts([o.reshape((B, n_blk * wb) + o.shape[3:])[:, :nw] for o in rows], key_format)
    new_entries = write_complete_windows(entries, encoded, start, n_valid, ratio=r)
    return (new_entries,) + open_window_state(win_kv, win_gate, prev_kv, prev_gate, start, n_valid, ratio=r,
                                              overlap=overlap)
