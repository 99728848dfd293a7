"""GPU Pallas (Triton backend) fused compressor chunk kernel: the contract is `reference.compress_chunk`.

One program = (batch row b, window w of the row's window grid). It gathers the window's slots straight from the
chunk's projected kv / gate (or the open-window state, or -- for the A-half of window 0 of an overlapping
compressor -- the previous-window state), pools them channel-wise with a softmax over the slots, rounds to
`norm_dtype`, RMS-normalises (weight), rotates the trailing RoPE channels at the window position, optionally
applies the 128-point Walsh-Hadamard rotation, encodes to the cache format and writes entry w in place
(`input_output_aliases`: rows of the cache that no window writes are never touched). Windows that are not complete
or land at w >= cap are skipped (masked stores).

Channels are processed in `dc`-wide chunks (the softmax is channel-wise, so chunks are independent until the RMS
statistic). Interleaved RoPE pairs (2i, 2i+1) and the fp4 nibble packing need each channel's pair partner: instead
of a register shuffle the kernel pools the pair-swapped channels too (a second gather of the same addresses) for
the RoPE chunk, and for the final rotation / packing it multiplies by a row-permuted matrix (M = H or I).

Formats (`key_format`): None -> cast to the cache dtype; "bf16"; "fp8" (indexer 132 B: e4m3 + f32 pow2 scale per
row); "fp4" (indexer 68 B: packed e2m1 low-nibble-first + 4 ue8m0 scales); "kv_fp8" (the main KV cache's 584-B
rows of sparse_attention.fp8_layout). Rounding rules are `formats.quantize`'s / `quantize_kv_fp8`'s.
The open-window state after the chunk (a gather of <= 2 * ratio rows per batch row) is produced by a small XLA
epilogue (`next_state`), identical to the reference's.
"""

from __future__ import annotations

import functools
from typing import Optional

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
# kernel

def _kernel(start_ref, nvalid_ref, kv_ref, gate_ref, skv_ref, sgate_ref, *refs, r, S, d, cd, dc, overlap, rd,
            eps, norm_dtype, key_format, rotate, cap, n_parts, interpret):
    it = iter(refs)
    if overlap:
        pkv_ref, pgate_ref = next(it), next(it)
    nw_ref, freq_ref = next(it), next(it)
    mix = None
    if key_format == "fp4":
        mix = (next(it), next(it))
    elif rotate:
        mix = (next(it), None)
    rest = list(it)
    outs = rest[-n_parts:]

    b = pl.program_id(0)
    w = pl.program_id(1)
    start = start_ref[b]
    nv = nvalid_ref[b]
    off = start % r
    win_pos = start - off + w * r
    dest = win_pos // r
    complete = (win_pos + r <= start + nv) & (dest < cap)
    n_chunks = d // dc
    slot = jax.lax.broadcasted_iota(jnp.int32, (r, 1), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (1, dc), 1)

    def gather(k_win, col0, swap):
        """(kv, gate) [r, dc] of window k_win's slots at channels col0 + [0, dc) (pair-swapped if swap)."""
        g = k_win * r + slot
        j = g - off
        from_chunk = (j >= 0) & (j < nv)
        from_state = g < off
        cols = col0 + (col ^ 1 if swap else col)
        jc = jnp.clip(j, 0, S - 1)
        gs = jnp.clip(g, 0, r - 1)
        m_c = jnp.broadcast_to(from_chunk, (r, dc))
        m_s = jnp.broadcast_to(from_state, (r, dc))
        out = []
        for cref, sref in ((kv_ref, skv_ref), (gate_ref, sgate_ref)):
            a = plgpu.load(cref.at[b, jc, cols], mask=m_c, other=0.0)
            s = plgpu.load(sref.at[b, gs, cols], mask=m_s, other=0.0)
            out.append(jnp.where(m_c, a, jnp.where(m_s, s, 0.0)))
        return out

    def pool(c0, swap):
        """pooled [dc] float32 of channels c0 + [0, dc) of entry w."""
        if overlap:
            bkv, bg = gather(w, d + c0, swap)
            akv, ag = gather(w - 1, c0, swap)
            cols = c0 + (col ^ 1 if swap else col)
            rows = jnp.broadcast_to(slot, (r, dc))
            first = jnp.broadcast_to(w == 0, (r, dc))
            pkv = plgpu.load(pkv_ref.at[b, rows, cols], mask=first, other=0.0)
            pg = plgpu.load(pgate_ref.at[b, rows, cols], mask=first, other=0.0)
            akv = jnp.where(first, pkv, akv)
            ag = jnp.where(first, pg, ag)
            m = jnp.maximum(jnp.max(ag, axis=0), jnp.max(bg, axis=0))
            ea = jnp.exp(ag - m[None, :])
            eb = jnp.exp(bg - m[None, :])
            num = jnp.sum(ea * akv, axis=0) + jnp.sum(eb * bkv, axis=0)
            den = jnp.sum(ea, axis=0) + jnp.sum(eb, axis=0)
        else:
            kv, g = gather(w, c0, swap)
            m = jnp.max(g, axis=0)
            e = jnp.exp(g - m[None, :])
            num = jnp.sum(e * kv, axis=0)
            den = jnp.sum(e, axis=0)
        return (num / den).astype(norm_dtype).astype(jnp.float32)

    pooled = [pool(c * dc, False) for c in range(n_chunks)]
    ss = pooled[0] * pooled[0]
    tot = jnp.sum(ss)
    for p in pooled[1:]:
        tot += jnp.sum(p * p)
    inv = jax.lax.rsqrt(tot / d + eps)
    colv = jax.lax.iota(jnp.int32, dc)
    nw = [nw_ref[pl.ds(c * dc, dc)] for c in range(n_chunks)]
    ys = [(pooled[c] * inv * nw[c]).astype(norm_dtype).astype(jnp.float32) for c in range(n_chunks)]
    # RoPE on the trailing rd channels (chunks entirely inside the rope range; rd % dc == 0 checked by caller)
    posf = win_pos.astype(jnp.float32)
    for c in range(n_chunks):
        if (c + 1) * dc <= d - rd:
            continue
        sw = pool(c * dc, True)
        nw_sw = plgpu.load(nw_ref.at[c * dc + (colv ^ 1)])
        ysw = (sw * inv * nw_sw).astype(norm_dtype).astype(jnp.float32)
        fcol = c * dc + colv - (d - rd)
        freq = plgpu.load(freq_ref.at[fcol // 2])
        ang = posf * freq
        cs, sn = jnp.cos(ang), jnp.sin(ang)
        sign = jnp.where((colv & 1) == 0, -1.0, 1.0)
        ys[c] = (ys[c] * cs + sign * ysw * sn).astype(norm_dtype).astype(jnp.float32)

    if mix is not None:
        m_ref, m2_ref = mix
        ri = jax.lax.broadcasted_iota(jnp.int32, (dc, dc), 0)
        ci = jax.lax.broadcasted_iota(jnp.int32, (dc, dc), 1)
        hi = jax.lax.broadcasted_iota(jnp.int32, (dc // 2, dc), 0)
        hc = jax.lax.broadcasted_iota(jnp.int32, (dc // 2, dc), 1)

        def apply(mref, rows_out):
            """[rows_out-chunked] M @ y with M [n_out, d] read in (rows, dc) blocks; returns chunks of `rows_out`."""
            rr, cc = (ri, ci) if rows_out == dc else (hi, hc)
            out = []
            for i in range(mref.shape[0] // rows_out):
                acc = jnp.zeros((rows_out,), jnp.float32)
                for c in range(n_chunks):
                    blk = plgpu.load(mref.at[i * rows_out + rr, c * dc + cc])
                    acc += jnp.sum(blk * ys[c][None, :], axis=1)
                out.append(acc)
            return out

    @pl.when(complete)
    def _store():
        if key_format in (None, "bf16"):
            (o_ref,) = outs
            zs = apply(m_ref, dc) if rotate else ys
            for c in range(n_chunks):
                o_ref[b, dest, pl.ds(c * dc, dc)] = zs[c].astype(o_ref.dtype)
        elif key_format == "kv_fp8":  # 448 e4m3 in 64-wide blocks with ue8m0 scales, 64 bf16 rope, 1 pad byte
            nope_ref, rope_ref, sc_ref = outs
            for c in range(n_chunks):
                z = ys[c].astype(jnp.bfloat16).astype(jnp.float32)   # the reference rounds rows through bf16
                if c * dc >= FP8_NOPE:
                    rope_ref[b, dest, pl.ds(c * dc - FP8_NOPE, dc)] = z.astype(rope_ref.dtype)
                    continue
                e = jnp.clip(jnp.ceil(jnp.log2(jnp.maximum(jnp.max(jnp.abs(z)), 1e-4) / formats.E4M3_MAX)),
                             -127, 127).astype(jnp.int32)
                nope_ref[b, dest, pl.ds(c * dc, dc)] = (z / exp2i(e)).astype(nope_ref.dtype)
                sc_ref[b, dest, c] = (e + 127).astype(sc_ref.dtype)
            sc_ref[b, dest, FP8_NOPE // dc] = jnp.asarray(127, sc_ref.dtype)
        elif key_format == "fp8":
            v_ref, s_ref = outs
            zs = apply(m_ref, dc) if rotate else ys
            amax = jnp.max(jnp.abs(zs[0]))
            for z in zs[1:]:
                amax = jnp.maximum(amax, jnp.max(jnp.abs(z)))
            s = exp2i(pow2_exponent(amax, formats.E4M3_MAX, 1e-4))
            for c in range(n_chunks):
                v_ref[b, dest, pl.ds(c * dc, dc)] = (zs[c] / s).astype(v_ref.dtype)
            s_ref[b, dest, 0] = s
        else:  # fp4: byte j = code(z[2j]) | code(z[2j + 1]) << 4, one ue8m0 scale per 32 channels (16 bytes)
            v_ref, s_ref = outs
            half = dc // 2
            ze = apply(m_ref, half)   # even channels of M y, in chunks of dc/2
            zo = apply(m2_ref, half)  # odd channels
            hb = formats.FP4_BLOCK // 2
            sub = jax.lax.iota(jnp.int32, half) // hb
            for c in range(len(ze)):
                a_abs = jnp.maximum(jnp.abs(ze[c]), jnp.abs(zo[c]))
                scale_v = jnp.zeros((half,), jnp.float32)
                for k in range(half // hb):
                    inb = sub == k
                    amax = jnp.max(jnp.where(inb, a_abs, 0.0))
                    e = jnp.clip(pow2_exponent(amax, formats.E2M1_MAX, formats.E2M1_MAX * 2.0 ** -126), -126, 127)
                    scale_v = jnp.where(inb, exp2i(e), scale_v)
                    s_ref[b, dest, (c * half) // hb + k] = (e + 127).astype(s_ref.dtype)
                byte = e2m1_code(ze[c] / scale_v) | (e2m1_code(zo[c] / scale_v) << 4)
                v_ref[b, dest, pl.ds(c * half, half)] = byte.astype(v_ref.dtype)


def compress_chunk_gpu(kv, gate, start, n_valid, state_kv, state_gate, prev_kv, prev_gate, entries, *, ratio: int,
                       overlap: bool, norm_weight, eps: float, inv_freq, norm_dtype=jnp.float32,
                       key_format: Optional[str] = None, rotate: bool = False, interpret: bool = False,
                       dc: Optional[int] = None, num_warps: Optional[int] = None, num_stages: int = 1):
    """Pallas GPU implementation of `reference.compress_chunk` with the encoding given explicitly:
    key_format None (cast to the cache dtype) | "bf16" | "fp8" | "fp4" (indexer formats), `rotate` = Hadamard first.
    Returns (entries, state_kv, state_gate, prev_kv, prev_gate)."""
    r = ratio
    B, S, cd = kv.shape
    d = cd // 2 if overlap else cd
    inv_freq = np.asarray(inv_freq, np.float32)
    rd = 2 * inv_freq.shape[0]
    dc = dc or min(64, d, rd)  # rope channels must be whole chunks
    if d % dc or rd % dc and dc % rd:
        raise ValueError(f"channel chunk {dc} must divide d={d} and the rope width {rd}")
    if rd > dc and rd % dc:
        raise ValueError("rope width must be a multiple of the channel chunk")
    if rd < dc:  # the rope channels must be whole chunks
        raise ValueError(f"rope width {rd} must be >= channel chunk {dc}")
    if key_format == "kv_fp8" and (d, rd, dc) != (FP8_NOPE + FP8_ROPE, FP8_ROPE, 64):
        raise ValueError(f"kv_fp8 rows need d = {FP8_NOPE}+{FP8_ROPE} with {FP8_ROPE} rope dims and 64-wide chunks")
    if key_format == "fp4" and dc % formats.FP4_BLOCK:
        raise ValueError("fp4 needs the channel chunk to be a multiple of 32")
    parts = entry_parts(entries, key_format)
    cap = parts[0].shape[1]
    nw = n_windows_of(S, r)
    start = start.astype(jnp.int32)
    n_valid = n_valid.astype(jnp.int32)
    kvf, gf = kv.astype(jnp.float32), gate.astype(jnp.float32)

    args = [start, n_valid, kvf, gf, state_kv, state_gate]
    if overlap:
        args += [prev_kv, prev_gate]
    args += [jnp.asarray(norm_weight, jnp.float32).reshape(d), jnp.asarray(inv_freq)]
    if key_format == "fp4" or rotate:
        m = mix_matrix(d, rotate)
        args += [jnp.asarray(m[0::2]), jnp.asarray(m[1::2])] if key_format == "fp4" else [jnp.asarray(m)]
    n_in = len(args)
    args += list(parts)
    full = lambda a: pl.BlockSpec(a.shape, lambda b, w: (0,) * a.ndim)
    in_specs = [full(a) for a in args]
    out_specs = [full(p) for p in parts]
    out_shape = [jax.ShapeDtypeStruct(p.shape, p.dtype) for p in parts]
    kernel = functools.partial(
        _kernel, r=r, S=S, d=d, cd=cd, dc=dc, overlap=overlap, rd=rd, eps=float(eps),
        norm_dtype=jnp.dtype(norm_dtype), key_format=key_format, rotate=rotate, cap=cap, n_parts=len(parts),
        interpret=interpret)
    extra = {}
    if not interpret:
        extra["compiler_params"] = plgpu.CompilerParams(num_warps=num_warps or (4 if r * dc <= 4096 else 8),
                                                        num_stages=num_stages)
    outs = pl.pallas_call(
        kernel, grid=(B, nw), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape, interpret=interpret,
        input_output_aliases={n_in + i: i for i in range(len(parts))}, name=f"compress_r{r}_d{d}", **extra,
    )(*args)
    if key_format in (None, "bf16"):
        new_entries = outs[0]
    elif key_format == "kv_fp8":
        new_entries = Fp8KVPool(*outs)
    else:
        new_entries = formats.QuantizedKeys(outs[0], outs[1], key_format)
    skv, sg, pkv, pg = next_state(kvf, gf, start, n_valid, state_kv, state_gate, prev_kv, prev_gate,
                                  ratio=r, overlap=overlap)
    return new_entries, skv, sg, pkv, pg
