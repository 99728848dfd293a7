"""The grouped matmul on the TPU: jax's Mosaic-TPU grouped matmul (`jax.experimental.pallas.ops.tpu.megablox.gmm`),
called with our contract.

    grouped_matmul_tpu(lhs [M, K], rhs [E, K, N], group_sizes [E], *, tiling=None, interpret=False)
        -> [M, N] float32

megablox visits only the (group, tile) pairs that hold rows, as our GPU kernel does. It needs M, K and N to be
multiples of the tiling (default (128, 128, 128), shrunk to small K / N here); M is padded inside. Rows past
sum(group_sizes) are set to 0 (the reference's result there). f32 operands multiply in f32 as the contract says
(megablox's dot takes jax's default matmul precision, one bf16 pass on the TPU, so it is traced under "highest").
Tested in Pallas' TPU interpreter and by its TPU lowering only (no TPU here).

    grouped_matmul_fp4_tpu(lhs [M, K], rhs: fp4.Fp4Weights, group_sizes [E], *, block_m=None, block_n=None,
                           interpret=False) -> [M, N] float32

The FP4 contract (`fp4.py`) on the TPU (session 48): our own Pallas kernel, since megablox takes no packed weights.
It reads the checkpoint's bytes (0.53 B a weight) and decodes them in VMEM, over the GPU kernels' work items
(`gpu.work_items`), so a group's weights are read once per row tile, and only for groups with rows. Before it, the
TPU ran the reference, which dequantizes every expert of the stack at each call (4.3 GB of bf16 for one of
V4-Flash's 256-expert matrices). A step decodes FP4_K_CHUNK bytes of K at a time, so its VMEM temporaries stay near
[512, block_n] words each. Checked in the interpreter and by its Mosaic lowering for a v6e target only.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .reference import check_operands


def kernel_applies(K: int, N: int) -> bool:
    """Whether megablox takes [.., K] x [E, K, N] with the default tiling (K and N multiples of min(128, K / N));
    impl "auto" runs the reference elsewhere."""
    return K % min(128, K) == 0 and N % min(128, N) == 0


@functools.partial(jax.jit, static_argnames=("tiling", "interpret"))
def grouped_matmul_tpu(lhs, rhs, group_sizes, *, tiling=None, interpret=False):
    from jax.experimental.pallas.ops.tpu.megablox import gmm

    M, K, E, N = check_operands(lhs, rhs, group_sizes)
    tm, tk, tn = tiling or (128, min(128, K), min(128, N))
    if K % tk or N % tn:
        raise ValueError(f"grouped_matmul (TPU): K = {K} and N = {N} must be multiples of the tiling {(tm, tk, tn)}")
    m_pad = -(-M // tm) * tm
    lhs_p = jnp.pad(lhs, ((0, m_pad - M), (0, 0))) if m_pad != M else lhs
    f32 = jnp.dtype(lhs.dtype) == jnp.float32
    with jax.default_matmul_precision("highest") if f32 else contextlib.nullcontext():
        out = gmm(lhs_p, rhs, group_sizes.astype(jnp.int32), preferred_element_type=jnp.float32,
                  tiling=(tm, tk, tn), interpret=interpret)
    total = jnp.sum(jnp.maximum(group_sizes, 0))
    return jnp.where(jnp.arange(M)[:, None] < total, out[:M], 0.0)


# ---------------------------------------------------------------------------------------------------- FP4 weights
# block_m: the rows of a work item (`gpu.work_items`: a group's rows in one tile of lhs); decode calls (a few rows a
# group) take 16, bf16's sublane tile. block_n: output columns a grid step. Unmeasured on a TPU (none here).
FP4_BLOCK_N = 128


def fp4_block_m(M: int) -> int:
    return 16 if M <= 1024 else 128


def fp4_kernel_applies(K: int, N: int) -> bool:
    """Whether `grouped_matmul_fp4_tpu` takes [.., K] x Fp4Weights [E, N, K / 2]: K a multiple of 256 (its 32-input
    scale blocks in whole 8-row tiles once transposed) and N of 128 (a lane tile)."""
    return K % 256 == 0 and N % FP4_BLOCK_N == 0


# packed bytes a step of the kernel's K loop: bounds its VMEM temporaries (the int32 codes, their transpose, two f32
# weight tiles) to ~[FP4_K_CHUNK, block_n] words each, whatever K is
FP4_K_CHUNK = 512


def _fp4_tpu_kernel(group_ref, tile_ref, offsets_ref, n_items_ref, lhs_even_ref, lhs_odd_ref, packed_ref,
                    scales_ref, out_ref, *, block_m):
    """One (N tile, work item) step: group g's [block_n, K / 2] bytes and [block_n, K / 32] scales, decoded K-major,
    FP4_K_CHUNK bytes at a time, to the [chunk, block_n] weights of the even and of the odd inputs (scaled, exact in
    f32, cast to lhs's dtype), the tile's rows times them, and the rows of group g stored (items sharing a tile are
    consecutive steps and write disjoint rows of the same resident output block)."""
    from .fp4 import _e2m1, _e8m0

    i = pl.program_id(1)

    @pl.when(i < n_items_ref[0])
    def _():
        g = group_ref[i]
        row0 = tile_ref[i] * block_m
        block_n, half_k = packed_ref.shape
        chunk = FP4_K_CHUNK if half_k % FP4_K_CHUNK == 0 else half_k
        factor = _e8m0(scales_ref[...].astype(jnp.int32).T)               # [K / 32, block_n]: 16 bytes a row
        dtype = lhs_even_ref.dtype
        prec = jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None

        acc = jnp.zeros(out_ref.shape, jnp.float32)
        for c0 in range(0, half_k, chunk):   # static: K / 2 / chunk steps (4 at V4-Flash's K = 4096)
            codes = packed_ref[:, c0:c0 + chunk].astype(jnp.int32).T           # [chunk, block_n]
            f = factor[c0 // 16:(c0 + chunk) // 16]
            f = jnp.broadcast_to(f[:, None, :], (chunk // 16, 16, block_n)).reshape(chunk, block_n)
            acc += jnp.dot(lhs_even_ref[:, c0:c0 + chunk], (_e2m1(codes & 15) * f).astype(dtype), precision=prec,
                           preferred_element_type=jnp.float32)
            acc += jnp.dot(lhs_odd_ref[:, c0:c0 + chunk], (_e2m1(codes >> 4) * f).astype(dtype), precision=prec,
                           preferred_element_type=jnp.float32)
        rows = row0 + jax.lax.broadcasted_iota(jnp.int32, acc.shape, 0)
        mine = (rows >= offsets_ref[g]) & (rows < offsets_ref[g + 1])
        out_ref[...] = jnp.where(mine, acc, out_ref[...])


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "interpret"))
def grouped_matmul_fp4_tpu(lhs, rhs, group_sizes, *, block_m=None, block_n=None, interpret=False):
    """lhs [M, K], rhs `fp4.Fp4Weights` (packed [E, N, K / 2] uint8, scales [E, N, K / 32] uint8), group_sizes [E]
    -> [M, N] f32: the FP4 contract (`fp4.grouped_matmul_fp4_reference`) on the TPU, the weights read as they are.

    Grid (N / block_n, work items), the items those of the GPU kernels (`gpu.work_items`: (group, row tile) pairs
    of the groups that have rows, ordered by group, so items sharing a tile are consecutive and its output block
    stays in VMEM between them); unused items repeat the last one's blocks and compute nothing. A step takes the
    whole K: a group's [block_n, K / 2] bytes and [block_n, K / 32] scales (whole last dims, as Mosaic's tiling
    wants for the scales' K / 32), transposes them to K-major int32, decodes both nibbles (`fp4._e2m1` x `_e8m0`,
    exact) into the weights of the even and the odd inputs, and multiplies them with lhs's even and odd columns (split
    once outside), FP4_K_CHUNK bytes a loop step, f32 accumulation; f32 lhs multiplies in f32 (the contract's
    `precision_for`). Checked in the TPU
    interpreter and by its Mosaic lowering for a v6e target; never run on a TPU (none here)."""
    from jax.experimental.pallas import tpu as pltpu

    from .fp4 import check_weights
    from .gpu import work_items

    E, K, N = check_weights(rhs)
    M = lhs.shape[0]
    if lhs.ndim != 2 or lhs.shape[1] != K or group_sizes.shape != (E,):
        raise ValueError(f"grouped_matmul_fp4_tpu: expected lhs [M, K = {K}] and group_sizes [E = {E}], got "
                         f"{lhs.shape} and {group_sizes.shape}")
    bm = block_m or fp4_block_m(M)
    bn = block_n or FP4_BLOCK_N
    if K % 256 or N % bn or bm % 8:
        raise ValueError(f"grouped_matmul_fp4_tpu: K = {K} must be a multiple of 256, N = {N} of block_n = {bn}, "
                         f"and block_m = {bm} of 8; impl='reference' takes any shape")
    m_pad = -(-M // bm) * bm
    lhs_p = jnp.pad(lhs, ((0, m_pad - M), (0, 0))) if m_pad != M else lhs
    lhs_even, lhs_odd = lhs_p[:, 0::2], lhs_p[:, 1::2]                   # the low / high nibbles' inputs
    item_group, item_tile, offsets = work_items(group_sizes, M, bm)
    n_items = jnp.sum(item_group >= 0).astype(jnp.int32)[None]

    def last_used(i, n_items_ref):   # unused items (past n_items) map to the last used one's blocks
        return jnp.minimum(i, jnp.maximum(n_items_ref[0] - 1, 0))

    def rows_map(n, i, group_ref, tile_ref, offsets_ref, n_items_ref):
        return tile_ref[last_used(i, n_items_ref)], 0

    def weights_map(n, i, group_ref, tile_ref, offsets_ref, n_items_ref):
        return jnp.maximum(group_ref[last_used(i, n_items_ref)], 0), n, 0

    def out_map(n, i, group_ref, tile_ref, offsets_ref, n_items_ref):
        return tile_ref[last_used(i, n_items_ref)], n

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4, grid=(N // bn, item_group.shape[0]),
        in_specs=[pl.BlockSpec((bm, K // 2), rows_map), pl.BlockSpec((bm, K // 2), rows_map),
                  pl.BlockSpec((None, bn, K // 2), weights_map), pl.BlockSpec((None, bn, K // 32), weights_map)],
        out_specs=pl.BlockSpec((bm, bn), out_map))
    out = pl.pallas_call(
        functools.partial(_fp4_tpu_kernel, block_m=bm), grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((m_pad, N), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret else False,
        name=f"grouped_matmul_fp4_tpu_m{bm}_n{bn}",
    )(item_group, item_tile, offsets, n_items, lhs_even, lhs_odd, rhs.packed, rhs.scales)
    rows = jnp.arange(M, dtype=jnp.int32)[:, None]
    return jnp.where(rows < offsets[-1], out[:M], 0.0)
