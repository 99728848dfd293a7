"""fp4 (packed e2m1) keys as the f16 A operand of the Mosaic indexer kernel's wgmma (`gpu_mosaic.py`, fmt "fp4").

A key row is 64 bytes of packed e2m1 (low nibble = even channel) + 4 ue8m0 scales, one per 32-channel group
(`formats`, 68 B). The kernel loads a block's bytes [rows, 64] from shared memory in Mosaic GPU's
`WGMMA_LAYOUT_UPCAST_2X` (each thread: 4 consecutive bytes = 8 consecutive channels of one row, all in one scale
group, per 32-bit register) and turns every register into four f16x2 registers of the `WGMMA_LAYOUT` [rows, 128]
f16 array the wgmma takes from registers: one inline-PTX sequence per register (`FP4_F16X4_SCALED_ASM`) places the
nibbles' bits in f16 (value x 2^-14, exact) and multiplies them by the group's factor 2^(15 - D), D = (the key's
largest group scale) - (this group's), so every operand value is e2m1 x 2^(1 - D) and the key's score takes
2^(smax - 128) after the head sum (`score_shift`).

Where the eight values land is free as long as q's channels move the same way: a dot product does not care about
the order of its K dimension. So a register's values do not go to the WGMMA positions of their own channels, but
to the four WGMMA registers of the same thread and row that `register_plan` assigns, and the wrapper permutes q's
128 channels by `channel_columns` (the column each channel lands in) before the kernel. The plan is derived from the
two layouts by emulating them in numpy (`layout_positions`) and checked for every thread: same row, and one
channel -> column map for all rows and threads (tests/test_indexer_mosaic_fp4.py).

Exactness: the f16 operand is exact while a group lies at most 2^24 below its key's largest group (D <= 24);
groups 25-39 below round in f16's subnormals, lower ones count as 0 (their share of the score is below 2^-24 of
the top group's scale). q arrives fake-quantized to fp4 (per-32-channel power-of-two scales); the wrapper divides
each (token, head) by a power of two (its largest magnitude's exponent, joining the head weight) and rounds to
f16: exact while a head's groups span at most ~2^22.
"""

from __future__ import annotations

import functools

import numpy as np

GROUP = 32            # channels per ue8m0 scale
# $4 = 4 packed bytes b0..b3 (8 channels: b_i's low nibble = channel 2i, high = 2i + 1), $5 = the group factor as
# an f16x2 splat. Out: $0 = (ch 0, ch 2), $1 = (ch 4, ch 6), $2 = (ch 1, ch 3), $3 = (ch 5, ch 7), each value =
# e2m1 x 2^-14 x factor. A nibble s ee m -> f16 bits s 0000ee m000000000 (the e2m1 exponent field lands in the f16
# exponent field: value x 2^-14, the e2m1 subnormal 0.5 becomes f16's subnormal 2^-15).
FP4_F16X4_SCALED_ASM = """{ .reg .b32 t0, t1, a, b;
prmt.b32 t0, $4, 0, 0x4140;
prmt.b32 t1, $4, 0, 0x4342;
shl.b32 a, t0, 9;  and.b32 a, a, 0x0E000E00; shl.b32 b, t0, 12; and.b32 b, b, 0x80008000; or.b32 a, a, b;
mul.rn.f16x2 $0, a, $5;
shl.b32 a, t1, 9;  and.b32 a, a, 0x0E000E00; shl.b32 b, t1, 12; and.b32 b, b, 0x80008000; or.b32 a, a, b;
mul.rn.f16x2 $1, a, $5;
shl.b32 a, t0, 5;  and.b32 a, a, 0x0E000E00; shl.b32 b, t0, 8;  and.b32 b, b, 0x80008000; or.b32 a, a, b;
mul.rn.f16x2 $2, a, $5;
shl.b32 a, t1, 5;  and.b32 a, a, 0x0E000E00; shl.b32 b, t1, 8;  and.b32 b, b, 0x80008000; or.b32 a, a, b;
mul.rn.f16x2 $3, a, $5; }"""
# the channels (of the register's 8) in the asm's output order: [out register][half]
ASM_CHANNELS = ((0, 2), (4, 6), (1, 3), (5, 7))


def _max_scale_ptx(word: str) -> str:
    """PTX: m = the largest of the 4 ue8m0 bytes of `word` (registers m, t declared by the caller)."""
    return (f"bfe.u32 m, {word}, 0, 8;\n" + "".join(f"bfe.u32 t, {word}, {8 * g}, 8; max.u32 m, m, t;\n"
                                                    for g in (1, 2, 3)))


# precision "fp8" (operand "e5m2"): the nibbles become e5m2 bytes for an e5m2 x e5m2 wgmma (twice the f16 rate, half
# the A registers). A key group's 8 magnitudes {0, .5, 1, 1.5 | 2, 3, 4, 6} x 2^(13 - D) (D: the group's distance
# below the key's largest scale) are a lookup table of 8 bytes in two registers, one table per (key, group):
# E5M2_LUT_BASE at D = 0 (0.5 x 2^13 = 2^12: exponent field 27), each nonzero entry's exponent field lowered by D
# (a subtraction of D x 4 per byte, no borrow while D <= E5M2_MAX_D: every entry stays a normal number, so exact);
# a group more than E5M2_MAX_D below its key's largest counts as 0 (its share of the score is below 2^-26 of the
# top group's). The key's score takes 2^(smax - 140).
E5M2_LUT_BASE = (0x72706C00, 0x7A787674)   # bytes: [0, 0x6C, 0x70, 0x72], [0x74, 0x76, 0x78, 0x7A]
E5M2_MAX_D = 26
# $2 = 4 packed bytes b0..b3 (b_i's low nibble = channel 2i, high = 2i + 1), $3 / $4 = the group's table (entries
# 0-3 / 4-7). Out: $0 = e5m2 bytes of channels 0-3, $1 = channels 4-7 (byte i = channel 4r + i). A nibble's 3
# magnitude bits index the table (prmt's default mode, selector bit 3 clear; prmt reads the low 16 bits of its
# selector, so one mask serves both halves); its sign comes from prmt's sign-replicate mode on (w << 4, w), whose
# bytes' top bits are the low and the high nibbles' sign bits. 9 SASS (ptxas 13, sm_90a; 10 before session 49's
# shared mask: `benchmarks/asm_sass_counts.py`).
FP4_E5M2X8_ASM = """{ .reg .b32 w4, m, sel, sg, o0, o1;
and.b32 m, $2, 0x77777777;
shl.b32 w4, $2, 4;
prmt.b32 o0, $3, $4, m;
prmt.b32 sg, w4, $2, 0xD9C8;
and.b32 sg, sg, 0x80808080;
or.b32 o0, o0, sg;
shr.b32 sel, m, 16;
prmt.b32 o1, $3, $4, sel;
prmt.b32 sg, w4, $2, 0xFBEA;
and.b32 sg, sg, 0x80808080;
or.b32 o1, o1, sg;
mov.b32 $0, o0;
mov.b32 $1, o1; }"""
E5M2_ASM_CHANNELS = ((0, 1, 2, 3), (4, 5, 6, 7))


def fp4_e5m2x8_reference(word, lut_lo, lut_hi):
    """numpy model of `FP4_E5M2X8_ASM`: word, lut_lo, lut_hi uint32 [n] -> uint8 [n, 2, 4] (out register, byte)."""
    word = np.asarray(word, np.uint64)
    table = (np.asarray(lut_lo, np.uint64) | (np.asarray(lut_hi, np.uint64) << np.uint64(32)))
    out = np.empty(word.shape + (2, 4), np.uint8)
    for ch in range(8):
        nib = (word >> np.uint64(4 * ch)) & np.uint64(0xF)
        mag = ((table >> (np.uint64(8) * (nib & np.uint64(7)))) & np.uint64(0xFF)).astype(np.uint8)
        out[..., ch // 4, ch % 4] = mag | ((nib & np.uint64(8)) << np.uint64(4)).astype(np.uint8)
    return out


def e5m2_luts(scales):
    """ue8m0 group scales [..., 4] (int) -> (tables uint32 [..., 4, 2]: group g's (entries 0-3, 4-7) as
    `E5M2_LUTS_ASM` forms them, zero for D_g > E5M2_MAX_D; factor f32 bits uint32 [...] = 2^(smax - 140))."""
    s = np.asarray(scales, np.int64)
    smax = s.max(-1)
    d = smax[..., None] - s
    lo = np.int64(E5M2_LUT_BASE[0]) - d * 0x04040400
    hi = np.int64(E5M2_LUT_BASE[1]) - d * 0x04040404
    ok = d <= E5M2_MAX_D
    tables = np.stack([np.where(ok, lo, 0), np.where(ok, hi, 0)], -1).astype(np.uint32)
    factor = e5m2_factor_bits(smax, np).astype(np.uint32)
    return tables, factor


def e5m2_factor_bits(smax, xp):
    """A key's largest group scale (int array, numpy or jax.numpy `xp`) -> the f32 bits of 2^(smax - 140), the
    score factor of precision "fp8"'s e5m2 operands (subnormal for smax < 14), as `E5M2_LUTS_ASM` forms them."""
    return xp.where(smax >= 14, (smax - 13) << 23, xp.left_shift(1, xp.clip(smax + 9, 0, 31)))


# $9 = a key's 4 ue8m0 group scales (byte g = group g). Out: $2g / $2g+1 = group g's table (`e5m2_luts`), $8 = the
# f32 bits of 2^(max - 140) (the score's factor; subnormal for max < 14).
E5M2_LUTS_ASM = """{ .reg .b32 m, s, t, d, k, lo, hi, f;
.reg .pred p;
""" + _max_scale_ptx("$9") + "".join(f"""bfe.u32 s, $9, {8 * g}, 8;
sub.u32 d, m, s;
mul.lo.u32 t, d, 0x04040400; mov.u32 k, {E5M2_LUT_BASE[0]:#010x}; sub.u32 lo, k, t;
mul.lo.u32 t, d, 0x04040404; mov.u32 k, {E5M2_LUT_BASE[1]:#010x}; sub.u32 hi, k, t;
setp.le.u32 p, d, {E5M2_MAX_D};
selp.b32 ${2 * g}, lo, 0, p;
selp.b32 ${2 * g + 1}, hi, 0, p;
""" for g in range(4)) + """setp.ge.u32 p, m, 14; sub.u32 t, m, 13; shl.b32 t, t, 23;
add.u32 s, m, 9; mov.u32 k, 1; shl.b32 s, k, s; selp.b32 $8, t, s, p; }"""


def fp4_f16x4_reference(word, factor_bits):
    """numpy model of `FP4_F16X4_SCALED_ASM` before the multiply, and the multiply in float16:
    word uint32 [n] (4 packed bytes), factor_bits uint16 [n] (the f16 factor) -> float16 [n, 4, 2] (out register,
    half)."""
    word = np.asarray(word, np.uint32)
    byte = [(word >> (8 * i)) & 0xFF for i in range(4)]
    out = np.empty(word.shape + (4, 2), np.float16)
    factor = np.asarray(factor_bits, np.uint16).view(np.float16).astype(np.float32)
    for r, chans in enumerate(ASM_CHANNELS):
        for h, ch in enumerate(chans):
            nib = (byte[ch // 2] >> (4 * (ch % 2))) & 0xF
            bits = ((nib & 7) << 9) | ((nib & 8) << 12)
            val = bits.astype(np.uint16).view(np.float16).astype(np.float32)
            out[..., r, h] = (val * factor).astype(np.float16)   # exact product rounded once, as mul.rn.f16x2
    return out


def layout_positions(layout, shape):
    """Emulates a Mosaic GPU `TiledLayout` on `shape`: -> positions [4 warps, 32 lanes, *registers_shape, vector]
    of logical indices (tuples), i.e. which element each thread's register vector element holds."""
    from jax.experimental.mosaic.gpu import fragmented_array as fa

    tiled = layout.tiling.tile_shape(shape)
    n = len(tiled)
    tt = layout.tiled_tiling_shape
    reg_shape = layout.registers_shape(shape)

    def delinearize(i, dims):
        sizes = [d.times if isinstance(d, fa.Replicated) else tt[d] for d in dims]
        out = {}
        for d, size in reversed(list(zip(dims, sizes))):
            if not isinstance(d, fa.Replicated):
                out[d] = i % size
            i //= size
        return out

    vec = tt[layout.vector_dim]
    pos = np.empty((4, 32) + reg_shape + (vec,), dtype=object)
    for w in range(4):
        for lane in range(32):
            fixed = {**delinearize(w, layout.warp_dims), **delinearize(lane, layout.lane_dims)}
            for idx in np.ndindex(reg_shape):
                for v in range(vec):
                    full = list(idx)
                    for d, i in fixed.items():
                        full[n + d] = i
                    full[n + layout.vector_dim] = v
                    pos[(w, lane) + idx + (v,)] = layout.tiling.untile_indices(tuple(full))
    return pos


# The operand the packed nibbles become (`fp4_operand(..., operand=)`): the kernel's precision "f16" takes "f16"
# (4 f16x2 registers per source register, WGMMA_LAYOUT), precision "fp8" takes "e5m2" (2 registers of 4 e5m2 bytes
# per source register, WGMMA_LAYOUT_8BIT).
OPERANDS = ("f16", "e5m2")


def _operand_layout(operand):
    """-> (Mosaic GPU layout of the [rows, 128] operand, target registers per source register, the asm's output
    channels [out register][element])."""
    from jax.experimental.mosaic.gpu import fragmented_array as fa

    if operand == "f16":
        return fa.WGMMA_LAYOUT, 4, ASM_CHANNELS
    if operand == "e5m2":
        return fa.WGMMA_LAYOUT_8BIT, 2, E5M2_ASM_CHANNELS
    raise ValueError(f"operand must be one of {OPERANDS}, got {operand!r}")


@functools.lru_cache(maxsize=None)
def register_plan(rows: int, operand: str = "f16"):
    """For a [rows, 64] uint8 block in WGMMA_LAYOUT_UPCAST_2X -> the [rows, 128] operand (`OPERANDS`: f16 in
    WGMMA_LAYOUT, e5m2 in WGMMA_LAYOUT_8BIT): (plan, channel_columns) where plan is a tuple over the source registers
    (in `np.ndindex` order of the source register array) of (source index, (the target register indices in the
    asm's output order: 4 for f16, 2 for e5m2), row-vector register index (of WGMMA_LAYOUT.reduce(1) on [rows]),
    scale group), and channel_columns [128] int32 the operand column each key channel lands in (the same for every
    row and thread; checked here for all 128 threads)."""
    from jax.experimental.mosaic.gpu import fragmented_array as fa

    dst_layout, n_out, out_channels = _operand_layout(operand)
    src = layout_positions(fa.WGMMA_LAYOUT_UPCAST_2X, (rows, 64))
    dst = layout_positions(dst_layout, (rows, 128))
    rowv = layout_positions(fa.WGMMA_LAYOUT.reduce((1,)), (rows,))
    src_regs = src.shape[2:-1]
    dst_regs = dst.shape[2:-1]
    row_regs = rowv.shape[2:-1]
    # thread (0, 0) defines the plan; every thread must agree with it
    plan = []
    by_row = {}
    for idx in np.ndindex(dst_regs):
        r = dst[(0, 0) + idx + (0,)][0]
        by_row.setdefault(r, []).append(idx)
    for r in by_row:
        by_row[r].sort(key=lambda i: dst[(0, 0) + i + (0,)][1])
    src_by_row = {}
    for idx in np.ndindex(src_regs):
        r, c = src[(0, 0) + idx + (0,)]
        src_by_row.setdefault(r, []).append((c, idx))
    row_reg_of = {rowv[(0, 0) + idx + (0,)][0]: idx for idx in np.ndindex(row_regs)}
    for r, items in src_by_row.items():
        items.sort()
        targets = by_row[r]
        if len(targets) != n_out * len(items):
            raise AssertionError(f"row {r}: {len(items)} source registers for {len(targets)} target registers")
        for j, (c, idx) in enumerate(items):
            plan.append((idx, tuple(targets[n_out * j:n_out * (j + 1)]), row_reg_of[r], c // (GROUP // 2)))
    plan.sort(key=lambda p: p[0])
    # check every thread and derive the channel -> column map
    columns = -np.ones(128, np.int64)
    for w in range(4):
        for lane in range(32):
            t = (w, lane)
            for idx, targets, row_idx, group in plan:
                bytes_ = [src[t + idx + (v,)] for v in range(4)]
                r = bytes_[0][0]
                if any(b[0] != r for b in bytes_) or [b[1] for b in bytes_] != list(range(bytes_[0][1],
                                                                                           bytes_[0][1] + 4)):
                    raise AssertionError(f"thread {t}: register {idx} is not 4 consecutive bytes of one row")
                if rowv[t + row_idx + (0,)][0] != r:
                    raise AssertionError(f"thread {t}: row register {row_idx} does not hold row {r}")
                if bytes_[0][1] // (GROUP // 2) != group:
                    raise AssertionError(f"thread {t}: register {idx} is not in group {group}")
                for out, chans in zip(targets, out_channels):
                    for h, ch in enumerate(chans):
                        rr, col = dst[t + out + (h,)]
                        channel = 2 * bytes_[0][1] + ch
                        if rr != r:
                            raise AssertionError(f"thread {t}: target {out} is row {rr}, not {r}")
                        if columns[channel] not in (-1, col):
                            raise AssertionError(f"channel {channel} lands in columns {columns[channel]} and {col}")
                        columns[channel] = col
    if sorted(columns.tolist()) != list(range(128)):
        raise AssertionError("the channel -> column map is not a permutation")
    return tuple(plan), columns.astype(np.int32)


def group_factor_bits(scales):
    """ue8m0 group scales [..., 4] (int) -> (factor f16 bits [..., 4] uint16 = 2^(15 - D_g) with D_g = max - s_g,
    subnormal for D_g in 30..39, 0 beyond; shift [...] int32 = smax - 128: the score's power of two)."""
    s = np.asarray(scales, np.int64)
    smax = s.max(-1, keepdims=True)
    d = smax - s
    bits = np.where(d <= 29, (30 - d) << 10, np.where(d <= 39, 1 << np.clip(39 - d, 0, 9), 0))
    return bits.astype(np.uint16), (smax[..., 0] - 128).astype(np.int32)


# $5 = a key's 4 ue8m0 group scales (byte g = group g). Out: $0..$3 = group g's factor 2^(15 - D_g) as an f16x2
# splat (D_g = max - s_g; subnormal for D_g in 30..39, 0 beyond: shl by more than 31 gives 0), $4 = the f32 bits
# of 2^(max - 128) (the score's factor; 2^-128 as a subnormal for max = 0).
SCALE_FACTORS_ASM = """{ .reg .b32 s, m, t, d, e, n, u, k;
.reg .pred p;
""" + _max_scale_ptx("$5") + "".join(f"""bfe.u32 s, $5, {8 * g}, 8;
sub.u32 d, m, s; mov.u32 k, 30; sub.u32 e, k, d; shl.b32 n, e, 10;
mov.u32 k, 39; sub.u32 t, k, d; mov.u32 k, 1; shl.b32 u, k, t;
setp.le.u32 p, d, 29; selp.b32 n, n, u, p; prmt.b32 ${g}, n, 0, 0x1010;
""" for g in range(4)) + """setp.ge.u32 p, m, 1; sub.u32 t, m, 1; shl.b32 t, t, 23; selp.b32 $4, t, 0x00200000, p; }"""


def fp4_operand(packed, scale_words, operand: str = "f16", raw: bool = False, tables=None):
    """In a Mosaic GPU kernel: packed [rows, 64] uint8 in `Layout.WGMMA_UPCAST_2X`, scale_words [rows] int32 (a
    key's 4 ue8m0 bytes) in `Layout.WGMMA.reduce(1)` -> (the operand [rows, 128], the K dimension in
    `register_plan(rows, operand)`'s column order: f16 in `Layout.WGMMA` (e2m1 x 2^(15 - D - 14)), or e5m2 in
    `Layout.WGMMA_8BIT` (e2m1 x 2^(13 - D)); row factor f32 [rows] in `Layout.WGMMA.reduce(1)`: the score of row t is
    the head sum over this operand x factor[t]). raw: a timing probe with wrong values: every operand register is
    the packed word it would be converted from (no conversion), the row factors as usual. tables (e5m2 only): the
    keys' 8 e5m2 table words already built (`e5m2_tables_by_row`), 8 int32 [rows] arrays in `Layout.WGMMA.reduce(1)`
    (word 2g / 2g + 1 = group g's entries 0-3 / 4-7); then scale_words is not read and the operand alone returns."""
    import jax.numpy as jnp
    from jax.experimental.pallas import mosaic_gpu as plgpu

    rows = packed.shape[0]
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    e5m2 = operand == "e5m2"
    out_layout, out_dtype = ((plgpu.Layout.WGMMA_8BIT, jnp.float8_e5m2) if e5m2 else
                             (plgpu.Layout.WGMMA, jnp.float16))
    operand_type = plgpu.ShapeDtypeStruct((rows, 128), out_dtype, layout=out_layout)
    if tables is not None:
        if not e5m2 or raw or len(tables) != 8:
            raise ValueError("tables: the 8 e5m2 table words of operand 'e5m2' (no raw probe)")

        @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA_UPCAST_2X,) + (row_layout,) * 8, return_type=operand_type)
        def convert_with_tables(_, x, *words):
            from jax.experimental.mosaic.gpu import utils as mgpu_utils

            i32 = _i32()
            per_group = {idx: [[mgpu_utils.bitcast(words[2 * g + h].registers[idx], i32) for h in (0, 1)]
                               for g in range(4)] for idx in np.ndindex(words[0].registers.shape)}
            return _operand_registers(x, per_group, rows, operand, raw=False)

        return convert_with_tables(packed, *tables)

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA_UPCAST_2X, row_layout),
                       return_type=(operand_type, plgpu.ShapeDtypeStruct((rows,), jnp.float32, layout=row_layout)))
    def convert(_, x, sw):
        from jax._src.lib.mlir import ir
        from jax._src.lib.mlir.dialects import llvm, vector
        from jax.experimental.mosaic import gpu as mgpu
        from jax.experimental.mosaic.gpu import utils as mgpu_utils

        i32 = _i32()
        f32 = ir.F32Type.get()
        # per row register: the groups' factors (f16: 4 f16x2 splats; e5m2: 4 (lo, hi) tables) and the row factor
        per_group, row_mult = {}, np.empty(sw.registers.shape, dtype=object)
        for idx, reg in np.ndenumerate(sw.registers):
            word = mgpu_utils.bitcast(reg, i32)
            if e5m2:
                outs = _e5m2_tables_asm(word)
                per_group[idx] = [outs[2 * g:2 * g + 2] for g in range(4)]
                fbits = outs[8]
            else:
                res = llvm.inline_asm(_struct(5), [word], SCALE_FACTORS_ASM, "=r,=r,=r,=r,=r,r")
                outs = [llvm.extractvalue(i32, res, [i]) for i in range(5)]
                per_group[idx] = [[o] for o in outs[:4]]
                fbits = outs[4]
            row_mult[idx] = vector.bitcast(ir.VectorType.get((1,), f32),
                                           vector.from_elements(ir.VectorType.get((1,), i32), [fbits]))
        return (_operand_registers(x, per_group, rows, operand, raw),
                mgpu.FragmentedArray(_registers=row_mult, _layout=sw.layout, _is_signed=None))

    return convert(packed, scale_words)


def _i32():
    from jax._src.lib.mlir import ir

    return ir.IntegerType.get_signless(32)


def _struct(n):
    from jax._src.lib.mlir import ir

    return ir.Type.parse("!llvm.struct<(" + ", ".join(["i32"] * n) + ")>")


def _e5m2_tables_asm(word):
    """MLIR: a key's scale word (i32) -> its 8 e5m2 table words and the f32 bits of its factor (9 i32 values,
    `E5M2_LUTS_ASM`)."""
    from jax._src.lib.mlir.dialects import llvm

    res = llvm.inline_asm(_struct(9), [word], E5M2_LUTS_ASM, ",".join(["=r"] * 9) + ",r")
    return [llvm.extractvalue(_i32(), res, [i]) for i in range(9)]


def _operand_registers(x, per_group, rows, operand, raw):
    """The operand FragmentedArray from the packed words x (WGMMA_UPCAST_2X) and, per row register index, the
    groups' asm inputs (f16: [factor splat]; e5m2: [table lo, table hi])."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import llvm
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    i32 = _i32()
    e5m2 = operand == "e5m2"
    plan, _ = register_plan(rows, operand)
    dst_layout = fa.WGMMA_LAYOUT_8BIT if e5m2 else fa.WGMMA_LAYOUT
    regs = np.empty(dst_layout.registers_shape((rows, 128)), dtype=object)
    reg_type = (ir.VectorType.get((4,), ir.Float8E5M2Type.get()) if e5m2 else
                ir.VectorType.get((2,), ir.F16Type.get()))
    asm, n_out = (FP4_E5M2X8_ASM, 2) if e5m2 else (FP4_F16X4_SCALED_ASM, 4)
    constraints = ",".join(["=r"] * n_out + ["r"] * (3 if e5m2 else 2))
    for src_idx, targets, row_idx, group in plan:
        word = mgpu_utils.bitcast(x.registers[src_idx], i32)
        if raw:   # timing probe: the packed word itself in each target register, nothing converted
            for t in targets:
                regs[t] = mgpu_utils.bitcast(word, reg_type)
            continue
        res = llvm.inline_asm(_struct(n_out), [word] + per_group[row_idx][group], asm, constraints)
        for i, t in enumerate(targets):
            regs[t] = mgpu_utils.bitcast(llvm.extractvalue(i32, res, [i]), reg_type)
    return mgpu.FragmentedArray(_registers=regs, _layout=dst_layout, _is_signed=None)


def e5m2_tables_by_row(scale_words):
    """In a Mosaic GPU kernel: scale_words [rows] int32 in `Layout.WG_STRIDED((rows,), vec_size=1)` (rows a multiple
    of 128: each thread a row, or two) -> (8 int32 [rows] arrays in the same layout: the e5m2 table words
    (`E5M2_LUTS_ASM`; word 2g / 2g + 1 = group g's entries 0-3 / 4-7), the keys' factors f32 [rows] = 2^(smax -
    140)). Built once a key, where `fp4_operand` builds them in each of the 4 threads that hold the key's row."""
    import jax.numpy as jnp
    from jax.experimental.pallas import mosaic_gpu as plgpu

    rows = scale_words.shape[0]
    layout = plgpu.Layout.WG_STRIDED((rows,), vec_size=1)

    @plgpu.inline_mgpu(arg_types=(layout,),
                       return_type=tuple(plgpu.ShapeDtypeStruct((rows,), jnp.int32, layout=layout) for _ in range(8))
                       + (plgpu.ShapeDtypeStruct((rows,), jnp.float32, layout=layout),))
    def build(_, sw):
        from jax._src.lib.mlir import ir
        from jax._src.lib.mlir.dialects import vector
        from jax.experimental.mosaic import gpu as mgpu
        from jax.experimental.mosaic.gpu import utils as mgpu_utils

        i32 = _i32()
        outs = [np.empty(sw.registers.shape, dtype=object) for _ in range(9)]
        for idx, reg in np.ndenumerate(sw.registers):
            words = _e5m2_tables_asm(mgpu_utils.bitcast(reg, i32))
            for k in range(9):
                outs[k][idx] = vector.from_elements(ir.VectorType.get((1,), i32), [words[k]])
            outs[8][idx] = vector.bitcast(ir.VectorType.get((1,), ir.F32Type.get()), outs[8][idx])
        return (tuple(mgpu.FragmentedArray(_registers=o, _layout=sw.layout, _is_signed=True) for o in outs[:8])
                + (mgpu.FragmentedArray(_registers=outs[8], _layout=sw.layout, _is_signed=None),))

    return build(scale_words)


# fp4_layout "rows" (session 50; the converter warpgroup of `gpu_mosaic`, precision "fp8"): each thread converts
# whole key rows. Thread t of the warpgroup holds row t (and t + 128, ... for longer blocks) as 16-byte vectors:
# 4 vectors of packed nibbles in (vector c = channels 32c..32c+31, one scale group), 8 vectors of e5m2 bytes out
# (vector j = channels 16j..16j+15), every channel in its own column (the asm writes channels in order), so q needs
# no permutation. Against the WGMMA-fragment layout (4 threads a row, one 32-bit register per access), a key's e5m2
# tables are built once rather than in each of 4 threads, and shared memory moves in 16-byte accesses: 4 loads and
# 8 stores a row instead of 16 and 32. The keys' swizzle 64 and the e5m2 slots' swizzle 128 keep 8 consecutive rows'
# 16-byte accesses on distinct banks. Counted offline (`benchmarks/mosaic_offline.py`, `benchmarks/sass_loops.py`):
# under the segment top-k the fragment layout's converter loop is 429 SASS a block and thread (36 stores, 20 loads,
# ~140 table instructions), this layout's 279.
ROWS_VECTOR_BYTES = 16


def rows_layout(cols: int):
    """The Mosaic GPU `TiledLayout` of fp4_layout "rows" for a [rows, cols] byte array (rows a multiple of 128):
    thread t of the warpgroup holds rows t, t + 128, ..., each as cols / 16 vectors of 16 consecutive bytes."""
    from jax.experimental.mosaic.gpu import fragmented_array as fa

    if cols % ROWS_VECTOR_BYTES:
        raise ValueError(f"cols must be a multiple of {ROWS_VECTOR_BYTES}, got {cols}")
    return fa.TiledLayout(fa.Tiling(((128, cols), (32, ROWS_VECTOR_BYTES))), warp_dims=(-4,), lane_dims=(-2,),
                          vector_dim=-1)


def rows_pallas_layout(cols: int):
    """`rows_layout(cols)` as a Pallas Mosaic GPU layout (`plgpu.Layout.TILED`), for loads and `inline_mgpu`."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    lay = rows_layout(cols)
    return plgpu.Layout.TILED(lay.tiling, warp_dims=lay.warp_dims, lane_dims=lay.lane_dims,
                              vector_dim=lay.vector_dim)


def check_rows_layout(rows: int) -> None:
    """Checks, for every thread, what `fp4_operand_rows` assumes of `rows_layout` (by `layout_positions`): register
    (i, 0, 0, c, 0, 0) holds bytes 16c..16c+15 of row 128 i + t (t: the thread's index in the warpgroup), for the
    packed [rows, 64] keys and the [rows, 128] operand alike, and the scale words' WG_STRIDED((rows,), 1) register i
    holds row 128 i + t."""
    if rows % 128:
        raise ValueError(f"fp4_layout 'rows' needs a multiple of 128 rows, got {rows}")
    for cols in (64, 128):
        pos = layout_positions(rows_layout(cols), (rows, cols))
        expect_regs = (rows // 128, 1, 1, cols // ROWS_VECTOR_BYTES, 1, 1)
        if pos.shape[2:-1] != expect_regs:
            raise AssertionError(f"registers {pos.shape[2:-1]}, expected {expect_regs}")
        for w in range(4):
            for lane in range(32):
                for i in range(rows // 128):
                    for c in range(cols // ROWS_VECTOR_BYTES):
                        got = [tuple(p) for p in pos[(w, lane, i, 0, 0, c, 0, 0)]]
                        want = [(128 * i + 32 * w + lane, 16 * c + v) for v in range(ROWS_VECTOR_BYTES)]
                        if got != want:
                            raise AssertionError(f"cols {cols}, thread ({w}, {lane}), register ({i}, {c}): {got}")


def fp4_operand_rows(packed, scale_words):
    """In a Mosaic GPU kernel (fp4_layout "rows"): packed [rows, 64] uint8 in `rows_pallas_layout(64)`, scale_words
    [rows] int32 (a key's 4 ue8m0 bytes) in `Layout.WG_STRIDED((rows,), vec_size=1)` -> (e5m2 [rows, 128] in
    `rows_pallas_layout(128)`, channel c in column c, = e2m1 x 2^(13 - D) as `fp4_operand(.., "e5m2")` makes it;
    the keys' factors f32 [rows] = 2^(smax - 140) in the scale words' layout). One `E5M2_LUTS_ASM` a row, one
    `FP4_E5M2X8_ASM` per 32-bit word of packed nibbles."""
    import jax.numpy as jnp
    from jax.experimental.pallas import mosaic_gpu as plgpu

    rows = packed.shape[0]
    if packed.shape != (rows, 64) or scale_words.shape != (rows,):
        raise ValueError(f"packed [rows, 64] and scale_words [rows], got {packed.shape} and {scale_words.shape}")
    check_rows_layout(rows)   # numpy, at trace time: the register positions this function relies on
    row_layout = plgpu.Layout.WG_STRIDED((rows,), vec_size=1)
    out_layout = rows_pallas_layout(128)

    @plgpu.inline_mgpu(arg_types=(rows_pallas_layout(64), row_layout),
                       return_type=(plgpu.ShapeDtypeStruct((rows, 128), jnp.float8_e5m2, layout=out_layout),
                                    plgpu.ShapeDtypeStruct((rows,), jnp.float32, layout=row_layout)))
    def convert(_, x, sw):
        from jax._src.lib.mlir import ir
        from jax._src.lib.mlir.dialects import llvm, vector
        from jax.experimental.mosaic import gpu as mgpu
        from jax.experimental.mosaic.gpu import utils as mgpu_utils

        i32 = _i32()
        words4 = ir.VectorType.get((4,), i32)
        e5m2x16 = ir.VectorType.get((ROWS_VECTOR_BYTES,), ir.Float8E5M2Type.get())
        out = np.empty(rows_layout(128).registers_shape((rows, 128)), dtype=object)
        factors = np.empty(sw.registers.shape, dtype=object)
        for i in range(rows // 128):
            tables = _e5m2_tables_asm(mgpu_utils.bitcast(sw.registers[i], i32))
            factors[i] = vector.bitcast(ir.VectorType.get((1,), ir.F32Type.get()),
                                        vector.from_elements(ir.VectorType.get((1,), i32), [tables[8]]))
            for c in range(4):   # source vector c: channels 32c..32c+31, scale group c
                src = mgpu_utils.bitcast(x.registers[i, 0, 0, c, 0, 0], words4)
                outs = []
                for k in range(4):   # word k: channels 32c + 8k .. +7 -> two words of e5m2 bytes in channel order
                    res = llvm.inline_asm(_struct(2), [vector.extract(src, [], [k]), tables[2 * c], tables[2 * c + 1]],
                                          FP4_E5M2X8_ASM, "=r,=r,r,r,r")
                    outs += [llvm.extractvalue(i32, res, [0]), llvm.extractvalue(i32, res, [1])]
                for h in range(2):   # operand vector 2c + h: channels 32c + 16h .. +15
                    out[i, 0, 0, 2 * c + h, 0, 0] = mgpu_utils.bitcast(
                        vector.from_elements(words4, outs[4 * h:4 * h + 4]), e5m2x16)
        return (mgpu.FragmentedArray(_registers=out, _layout=rows_layout(128), _is_signed=None),
                mgpu.FragmentedArray(_registers=factors, _layout=sw.layout, _is_signed=None))

    return convert(packed, scale_words)


def store_rows_slot(vals, factor, slot_ref, factor_ref, swizzle: int = 128):
    """In a Mosaic GPU kernel (fp4_layout "rows"): stores the converted operand (`fp4_operand_rows`' e5m2 [rows,
    128] in `rows_pallas_layout(128)`) into its e5m2 slot (a [rows, 128] ref tiled (8, 128), swizzled `swizzle`)
    and the factors ([rows] f32, WG_STRIDED) into theirs, as plain shared-memory stores. Pallas' `ref[...] = v`
    brackets each store with warpgroup barriers (its automatic barriers: 4 a block for the two stores); the
    converter's own protocol already orders them (the slot's empty barrier before, commit_smem's barrier after)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    rows = vals.shape[0]

    @plgpu.inline_mgpu(arg_types=(rows_pallas_layout(128), plgpu.Layout.WG_STRIDED((rows,), vec_size=1),
                                  plgpu.RefType((plgpu.TilingTransform((8, 128)), plgpu.SwizzleTransform(swizzle))),
                                  plgpu.RefType()))
    def store(_, v, f, slot, fslot):
        v.store_tiled(slot, swizzle=swizzle)
        f.store_untiled(fslot)

    store(vals, factor, slot_ref, factor_ref)
