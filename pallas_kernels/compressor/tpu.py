"""TPU Pallas (Mosaic) fused compressor chunk kernel; the contract is `reference.compress_chunk`.

Grid (batch row b, window w of the row's window grid); `start` and `n_valid` are scalar-prefetched. The chunk's kv /
gate stay in HBM (`pl.ANY`): each step DMAs the `ratio` chunk rows of window w (and of window w - 1 for the A-half
of an overlapping compressor) into VMEM, starting at the window's first chunk token clamped to the chunk; the
first window of a row whose start is not window-aligned is realigned with a sublane roll (`pltpu.roll`) and its
leading slots taken from the open-window state. Then: channel-wise softmax pooling, rounding to `norm_dtype`,
RMSNorm, RoPE at the window position (pair partner via lane rolls), optional Hadamard (MXU, f32), encoding (cache
dtype, indexer bf16 / fp8 / fp4, or the main KV cache's 584-B FP8 rows), and a DMA of the finished row (and its
scales) into the aliased cache at entry w, only for complete windows with w < cap.
The new open-window state comes from the shared XLA epilogue `gpu.next_state`.

Status: validated in the TPU interpreter (`pltpu.InterpretParams`) on CPU, and Pallas' Mosaic lowering for a TPU
(v6e) target runs in CI (`tests/test_tpu_lowering.py`); no TPU compile (libtpu) has been run.
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
from .gpu import (e2m1_code, entries_from_parts, entry_parts, exp2i, mix_matrix, n_windows_of, next_state,
                  pow2_exponent)


def _kernel(start_ref, nvalid_ref, kv_hbm, gate_hbm, skv_ref, sgate_ref, *refs, r, S, d, cd, overlap, eps,
            norm_dtype, key_format, rotate, cap, n_parts):
    it = iter(refs)
    if overlap:
        pkv_ref, pgate_ref = next(it), next(it)
    nw_ref, freq_ref = next(it), next(it)
    m_refs = []
    if key_format == "fp4":
        m_refs = [next(it), next(it)]
    elif rotate:
        m_refs = [next(it)]
    ins_alias = [next(it) for _ in range(n_parts)]
    del ins_alias
    outs = [next(it) for _ in range(n_parts)]
    buf_kv, buf_g, row_scr = next(it), next(it), [next(it) for _ in range(n_parts)]
    sem = next(it)

    b = pl.program_id(0)
    w = pl.program_id(1)
    start = start_ref[b]
    nv = nvalid_ref[b]
    off = start % r
    win_pos = start - off + w * r
    dest = win_pos // r
    complete = (win_pos + r <= start + nv) & (dest < cap)
    slot = jax.lax.broadcasted_iota(jnp.int32, (r, cd), 0)

    def window(k, which):
        """(kv, gate) [r, cd] of window k's slots (reference `fill`)."""
        j_first = k * r - off
        s0 = jnp.clip(j_first, 0, S - r)
        copies = [pltpu.make_async_copy(src.at[b, pl.ds(s0, r)], dst.at[which], sem.at[i])
                  for i, (src, dst) in enumerate(((kv_hbm, buf_kv), (gate_hbm, buf_g)))]
        for c in copies:
            c.start()
        for c in copies:
            c.wait()
        shift = (s0 - j_first) % r
        j = j_first + slot
        from_chunk = (j >= 0) & (j < nv)
        g = k * r + slot
        from_state = g < off
        out = []
        for bref, sref in ((buf_kv, skv_ref), (buf_g, sgate_ref)):
            x = pltpu.roll(bref[which], shift, 0)
            out.append(jnp.where(from_chunk, x, jnp.where(from_state, sref[...], 0.0)))
        return out

    kv_b, g_b = window(w, 0)
    if overlap:
        kv_a, g_a = window(jnp.maximum(w - 1, 0), 1)
        first = w == 0
        akv = jnp.where(first, pkv_ref[...], kv_a[:, :d])
        ag = jnp.where(first, pgate_ref[...], g_a[:, :d])
        bkv, bg = kv_b[:, d:], g_b[:, d:]
        m = jnp.maximum(jnp.max(ag, axis=0, keepdims=True), jnp.max(bg, axis=0, keepdims=True))
        ea, eb = jnp.exp(ag - m), jnp.exp(bg - m)
        num = jnp.sum(ea * akv, axis=0, keepdims=True) + jnp.sum(eb * bkv, axis=0, keepdims=True)
        den = jnp.sum(ea, axis=0, keepdims=True) + jnp.sum(eb, axis=0, keepdims=True)
    else:
        m = jnp.max(g_b, axis=0, keepdims=True)
        e = jnp.exp(g_b - m)
        num = jnp.sum(e * kv_b, axis=0, keepdims=True)
        den = jnp.sum(e, axis=0, keepdims=True)
    p = (num / den).astype(norm_dtype).astype(jnp.float32)                 # [1, d]
    inv = jax.lax.rsqrt(jnp.sum(p * p, axis=1, keepdims=True) / d + eps)
    y = (p * inv * nw_ref[...]).astype(norm_dtype).astype(jnp.float32)
    # RoPE: partner of channel c is c ^ 1 (lane rolls); freq row is 0 outside the rope channels
    col = jax.lax.broadcasted_iota(jnp.int32, (1, d), 1)
    even = (col & 1) == 0
    partner = jnp.where(even, pltpu.roll(y, d - 1, 1), pltpu.roll(y, 1, 1))
    ang = win_pos.astype(jnp.float32) * freq_ref[...]
    rot = y * jnp.cos(ang) + jnp.where(even, -1.0, 1.0) * partner * jnp.sin(ang)
    y = jnp.where(freq_ref[...] != 0, rot.astype(norm_dtype).astype(jnp.float32), y)

    def mix(mref):
        y8 = jnp.broadcast_to(y, (8, d))
        return jax.lax.dot_general(y8, mref[...], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                                   precision=jax.lax.Precision.HIGHEST)[0:1]

    if key_format in (None, "bf16"):
        z = mix(m_refs[0]) if rotate else y
        row_scr[0][...] = z.astype(row_scr[0].dtype)
    elif key_format == "fp8":
        z = mix(m_refs[0]) if rotate else y
        s = exp2i(pow2_exponent(jnp.max(jnp.abs(z)), formats.E4M3_MAX, 1e-4))
        row_scr[0][...] = (z / s).astype(row_scr[0].dtype)
        row_scr[1][...] = jnp.full((1, 1), s, jnp.float32)
    elif key_format == "kv_fp8":  # 584-B rows: 7 x 64 e4m3 with ue8m0 scales, 64 bf16 rope, 1 pad scale byte
        z = round_to_bf16(y)                                                # the format rounds rows through bf16
        nb = FP8_NOPE // 64
        blk = col // 64
        scale = jnp.ones((1, d), jnp.float32)
        sbytes = jnp.full((1, row_scr[2].shape[-1]), 127, jnp.int32)
        scol = jax.lax.broadcasted_iota(jnp.int32, sbytes.shape, 1)
        for c in range(nb):
            amax = jnp.max(jnp.where(blk == c, jnp.abs(z), 0.0))
            e = fp8_block_exponent(amax)
            scale = jnp.where(blk == c, exp2i(e), scale)
            sbytes = jnp.where(scol == c, e + 127, sbytes)
        row_scr[0][...] = (z / scale)[:, :FP8_NOPE].astype(row_scr[0].dtype)
        row_scr[1][...] = z[:, FP8_NOPE:].astype(row_scr[1].dtype)
        row_scr[2][...] = sbytes.astype(row_scr[2].dtype)
    else:
        ze, zo = mix(m_refs[0]), mix(m_refs[1])                              # [1, d/2] even / odd channels
        grp = jax.lax.broadcasted_iota(jnp.int32, ze.shape, 1) // (formats.FP4_BLOCK // 2)
        a_abs = jnp.maximum(jnp.abs(ze), jnp.abs(zo))
        scale = jnp.ones(ze.shape, jnp.float32)
        sbytes = jnp.zeros((1, d // formats.FP4_BLOCK), jnp.int32)
        gcol = jax.lax.broadcasted_iota(jnp.int32, sbytes.shape, 1)
        for g in range(d // formats.FP4_BLOCK):
            amax = jnp.max(jnp.where(grp == g, a_abs, 0.0))
            e = jnp.clip(pow2_exponent(amax, formats.E2M1_MAX, formats.E2M1_MAX * 2.0 ** -126), -126, 127)
            scale = jnp.where(grp == g, exp2i(e), scale)
            sbytes = jnp.where(gcol == g, e + 127, sbytes)
        byte = e2m1_code(ze / scale) | (e2m1_code(zo / scale) << 4)
        row_scr[0][...] = byte.astype(row_scr[0].dtype)
        row_scr[1][...] = sbytes.astype(row_scr[1].dtype)

    @pl.when(complete)
    def _write():
        copies = [pltpu.make_async_copy(row_scr[i], outs[i].at[b, pl.ds(dest, 1)], sem.at[2 + i])
                  for i in range(n_parts)]
        for c in copies:
            c.start()
        for c in copies:
            c.wait()


def compress_chunk_tpu(kv, gate, start, n_valid, state_kv, state_gate, prev_kv, prev_gate, entries, *, ratio: int,
                       overlap: bool, norm_weight, eps: float, inv_freq, norm_dtype=jnp.float32,
                       key_format: Optional[str] = None, rotate: bool = False, interpret: bool = False):
    """Mosaic TPU implementation of `reference.compress_chunk` with explicit encoding (see `gpu.compress_chunk_gpu`)."""
    r = ratio
    B, S, cd = kv.shape
    d = cd // 2 if overlap else cd
    inv_freq = np.asarray(inv_freq, np.float32)
    rd = 2 * inv_freq.shape[0]
    parts = entry_parts(entries, key_format)
    if key_format == "kv_fp8" and (d != FP8_NOPE + FP8_ROPE or rd != FP8_ROPE or rotate):
        raise ValueError(f"kv_fp8 rows need d = {FP8_NOPE}+{FP8_ROPE} with {FP8_ROPE} rope dims and no rotation")
    cap = parts[0].shape[1]
    nw = n_windows_of(S, r)
    start = start.astype(jnp.int32)
    n_valid = n_valid.astype(jnp.int32)
    kvf, gf = kv.astype(jnp.float32), gate.astype(jnp.float32)
    Sk = max(S, r)
    kvk, gk = kvf, gf
    if Sk != S:  # DMA windows of `ratio` rows need at least that many (decode: S = 1)
        kvk = jnp.pad(kvf, ((0, 0), (0, Sk - S), (0, 0)))
        gk = jnp.pad(gf, ((0, 0), (0, Sk - S), (0, 0)))
    freq_row = np.zeros((1, d), np.float32)
    freq_row[0, d - rd:] = np.repeat(inv_freq, 2)
    vmem_row = lambda shape: pl.BlockSpec(shape, lambda b, w, *_: (0,) * len(shape))
    per_row = lambda shape: pl.BlockSpec((None,) + shape, lambda b, w, *_: (b,) + (0,) * len(shape))
    args = [kvk, gk, state_kv, state_gate]
    in_specs = [pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY), per_row((r, cd)),
                per_row((r, cd))]
    if overlap:
        args += [prev_kv, prev_gate]
        in_specs += [per_row((r, d)), per_row((r, d))]
    args += [jnp.asarray(norm_weight, jnp.float32).reshape(1, d), jnp.asarray(freq_row)]
    in_specs += [vmem_row((1, d)), vmem_row((1, d))]
    if key_format == "fp4" or rotate:
        m = mix_matrix(d, rotate)
        mats = [m[0::2], m[1::2]] if key_format == "fp4" else [m]
        args += [jnp.asarray(x) for x in mats]
        in_specs += [vmem_row(x.shape) for x in mats]
    n_in = len(args) + 2  # + the two scalar-prefetch operands
    args += list(parts)
    in_specs += [pl.BlockSpec(memory_space=pl.ANY) for _ in parts]
    scratch = [pltpu.VMEM((2, r, cd), jnp.float32), pltpu.VMEM((2, r, cd), jnp.float32)]
    scratch += [pltpu.VMEM((1,) + p.shape[2:], p.dtype) for p in parts]
    scratch += [pltpu.SemaphoreType.DMA((2 + len(parts),))]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=(B, nw), in_specs=in_specs,
        out_specs=[pl.BlockSpec(memory_space=pl.ANY) for _ in parts], scratch_shapes=scratch)
    kernel = functools.partial(
        _kernel, r=r, S=Sk, d=d, cd=cd, overlap=overlap, eps=float(eps), norm_dtype=jnp.dtype(norm_dtype),
        key_format=key_format, rotate=rotate, cap=cap, n_parts=len(parts))
    extra = dict(interpret=pltpu.InterpretParams()) if interpret else {}
    outs = pl.pallas_call(
        kernel, grid_spec=grid_spec, out_shape=[jax.ShapeDtypeStruct(p.shape, p.dtype) for p in parts],
        input_output_aliases={n_in + i: i for i in range(len(parts))},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        name=f"compress_tpu_r{r}_d{d}", **extra,
    )(start, n_valid, *args)
    new_entries = entries_from_parts(outs, key_format)
    skv, sg, pkv, pg = next_state(kvf, gf, start, n_valid, state_kv, state_gate, prev_kv, prev_gate,
                                  ratio=r, overlap=overlap)
    return new_entries, skv, sg, pkv, pg
