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


@functools.lru_cache(maxsize=None)
def register_plan(rows: int):
    """For a [rows, 64] uint8 block in WGMMA_LAYOUT_UPCAST_2X -> f16 [rows, 128] in WGMMA_LAYOUT:
    (plan, channel_columns) where plan is a tuple over the source registers (in `np.ndindex` order of the source
    register array) of (source index, (4 target register indices in the asm's output order), row-vector register
    index (of WGMMA_LAYOUT.reduce(1) on [rows]), scale group), and channel_columns [128] int32 the f16 column each
    key channel lands in (the same for every row and thread; checked here for all 128 threads)."""
    from jax.experimental.mosaic.gpu import fragmented_array as fa

    src = layout_positions(fa.WGMMA_LAYOUT_UPCAST_2X, (rows, 64))
    dst = layout_positions(fa.WGMMA_LAYOUT, (rows, 128))
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
        if len(targets) != 4 * len(items):
            raise AssertionError(f"row {r}: {len(items)} source registers for {len(targets)} target registers")
        for j, (c, idx) in enumerate(items):
            plan.append((idx, tuple(targets[4 * j:4 * j + 4]), row_reg_of[r], c // (GROUP // 2)))
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
                for out, chans in zip(targets, ASM_CHANNELS):
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
bfe.u32 m, $5, 0, 8;
bfe.u32 t, $5, 8, 8;  max.u32 m, m, t;
bfe.u32 t, $5, 16, 8; max.u32 m, m, t;
bfe.u32 t, $5, 24, 8; max.u32 m, m, t;
""" + "".join(f"""bfe.u32 s, $5, {8 * g}, 8;
sub.u32 d, m, s; mov.u32 k, 30; sub.u32 e, k, d; shl.b32 n, e, 10;
mov.u32 k, 39; sub.u32 t, k, d; mov.u32 k, 1; shl.b32 u, k, t;
setp.le.u32 p, d, 29; selp.b32 n, n, u, p; prmt.b32 ${g}, n, 0, 0x1010;
""" for g in range(4)) + """setp.ge.u32 p, m, 1; sub.u32 t, m, 1; shl.b32 t, t, 23; selp.b32 $4, t, 0x00200000, p; }"""


def fp4_operand(packed, scale_words):
    """In a Mosaic GPU kernel: packed [rows, 64] uint8 in `Layout.WGMMA_UPCAST_2X`, scale_words [rows] int32 (a
    key's 4 ue8m0 bytes) in `Layout.WGMMA.reduce(1)` -> (operand f16 [rows, 128] in `Layout.WGMMA`, the K dimension
    in `register_plan`'s column order; row factor f32 [rows] in `Layout.WGMMA.reduce(1)`: the score of row t is the
    head sum over this operand x factor[t])."""
    import jax.numpy as jnp
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import llvm, vector
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    from jax.experimental.pallas import mosaic_gpu as plgpu

    rows = packed.shape[0]
    plan, _ = register_plan(rows)
    row_layout = plgpu.Layout.WGMMA.reduce(1)

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA_UPCAST_2X, row_layout),
                       return_type=(plgpu.ShapeDtypeStruct((rows, 128), jnp.float16, layout=plgpu.Layout.WGMMA),
                                    plgpu.ShapeDtypeStruct((rows,), jnp.float32, layout=row_layout)))
    def convert(_, x, sw):
        i32 = ir.IntegerType.get_signless(32)
        f32 = ir.F32Type.get()
        struct = lambda n: ir.Type.parse("!llvm.struct<(" + ", ".join(["i32"] * n) + ")>")
        factors, row_mult = {}, np.empty(sw.registers.shape, dtype=object)
        for idx, reg in np.ndenumerate(sw.registers):
            res = llvm.inline_asm(struct(5), [mgpu_utils.bitcast(reg, i32)], SCALE_FACTORS_ASM, "=r,=r,=r,=r,=r,r")
            outs = [llvm.extractvalue(i32, res, [i]) for i in range(5)]
            factors[idx] = outs[:4]
            row_mult[idx] = vector.bitcast(ir.VectorType.get((1,), f32),
                                           vector.from_elements(ir.VectorType.get((1,), i32), [outs[4]]))
        from jax.experimental.mosaic.gpu import fragmented_array as fa

        dst_shape = fa.WGMMA_LAYOUT.registers_shape((rows, 128))
        regs = np.empty(dst_shape, dtype=object)
        f16x2 = ir.VectorType.get((2,), ir.F16Type.get())
        for src_idx, targets, row_idx, group in plan:
            word = mgpu_utils.bitcast(x.registers[src_idx], i32)
            res = llvm.inline_asm(struct(4), [word, factors[row_idx][group]], FP4_F16X4_SCALED_ASM,
                                  "=r,=r,=r,=r,r,r")
            for i, t in enumerate(targets):
                regs[t] = mgpu_utils.bitcast(llvm.extractvalue(i32, res, [i]), f16x2)
        return (mgpu.FragmentedArray(_registers=regs, _layout=fa.WGMMA_LAYOUT, _is_signed=None),
                mgpu.FragmentedArray(_registers=row_mult, _layout=sw.layout, _is_signed=None))

    return convert(packed, scale_words)
