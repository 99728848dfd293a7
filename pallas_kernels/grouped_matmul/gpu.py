"""The grouped matmul as a Pallas (Triton backend) GPU kernel: only the groups that have rows are read.

    grouped_matmul_gpu(lhs [M, K], rhs [E, K, N], group_sizes [E], *, block_m=None, block_n=None, block_k=None,
                       num_warps=None, num_stages=None, interpret=False) -> [M, N] float32

Work items: every (group, M tile) pair that holds rows of the group: a group's rows [lo, hi) cover the tiles
lo // block_m .. (hi - 1) // block_m, so there are at most M / block_m + E items (a tile is shared by the groups
whose boundaries fall inside it). The items are listed in jnp before the launch (`work_items`, static length
`max_items`, the unused ones marked -1); grid = (max_items, N / block_n). A program multiplies its tile's rows by
rhs[group][:, its columns] over K in block_k steps (f32 accumulation on the tensor cores) and stores only the rows
of its group (a masked store), so items sharing a tile write disjoint rows. An unused item returns at once.

Cost: every active group's weights are read once per (M tile, N tile), i.e. once at decode (a group's few rows sit in
one or two tiles); groups without rows are never read, and no FLOP is spent on another group's rows. XLA's
`ragged_dot` on the GPU reads all E groups and does E x the FLOPs (`reference.py`).

Rows past sum(group_sizes) belong to no item; the wrapper sets them to 0 (the reference's result there).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from .reference import check_operands, precision_for

# decode-shaped defaults (a few rows per group, weight-streaming): 16-row tiles (the tensor cores' smallest M).
# Session 46 (H100, 256 experts, batches 16 / 64): block_n 256 and (8 warps, 3 stages) within 1% of these,
# block_n 64 5% slower. block_m None: `default_block_m(M)`. Prefill (session 48, H100, 256 experts, default tiles,
# 64 rows at these M): 4833.6 us at 512 tokens (1.04x the read floor), 6918.3 at 2048 (1.49x).
DEFAULT_CONFIG = dict(block_m=None, block_n=128, block_k=64, num_warps=4, num_stages=4)


def default_block_m(M: int) -> int:
    """Rows per tile: 16 at decode (a group's few rows in one tile); more rows per tile as M grows, since every
    (tile, N tile) program reads its group's K x block_n weights once (prefill: M / block_m reads of each)."""
    return 16 if M <= 1024 else 64 if M <= 16384 else 128


def fit_block(default: int, dim: int, name: str) -> int:
    """The widest power-of-two block <= `default` that divides `dim`, at least 16 (the tensor cores' smallest K / N
    tile): 128 for 4096, 32 for 96. A dim that is no multiple of 16 has none: the kernel cannot take it."""
    b = default
    while b >= 16 and dim % b:
        b //= 2
    if b < 16:
        raise ValueError(f"grouped_matmul (GPU kernel): {name} = {dim} is not a multiple of 16; use "
                         f"impl='reference' for such shapes")
    return b


def kernel_applies(K: int, N: int) -> bool:
    """Whether the kernel takes [.., K] x [E, K, N] with its default blocks (K and N multiples of 16); impl "auto"
    runs the reference elsewhere."""
    return K % 16 == 0 and N % 16 == 0


def work_items(group_sizes, M: int, block_m: int):
    """group_sizes [E] int32 -> (item_group [max_items] int32 (-1: unused), item_tile [max_items] int32, offsets
    [E + 1] int32), max_items = ceil(M / block_m) + E; items ordered by group, then tile. Offsets are clamped to
    [0, M] (negative sizes count as 0, rows past M belong to no group), so no item reaches past lhs."""
    E = group_sizes.shape[0]
    max_items = -(-M // block_m) + E
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    offsets = jnp.minimum(jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(sizes)]), M)
    sizes = offsets[1:] - offsets[:-1]
    lo, hi = offsets[:-1], offsets[1:]
    first_tile = lo // block_m
    n_tiles = jnp.where(sizes > 0, (hi - 1) // block_m - first_tile + 1, 0)
    item_group = jnp.repeat(jnp.arange(E, dtype=jnp.int32), n_tiles, total_repeat_length=max_items)
    starts = jnp.cumsum(n_tiles) - n_tiles                     # each group's first item
    idx = jnp.arange(max_items, dtype=jnp.int32)
    valid = idx < jnp.sum(n_tiles)
    item_tile = first_tile[item_group] + idx - starts[item_group]
    return jnp.where(valid, item_group, -1), jnp.where(valid, item_tile, 0), offsets


def grouped_kernel(body, *, block_m, block_n):
    """The work-item scaffold both kernels share (this module's and `fp4.py`'s): program (item i, N tile n) returns
    at once for an unused item, else gets its group's rows [lo, hi), takes `body(g, row0, col0, lhs_ref,
    *weight_refs)` -> the f32 [block_m, block_n] product of the tile's rows with group g's weights, and stores the
    rows of its group only (a masked store: items sharing a tile write disjoint rows)."""

    def kernel(group_ref, tile_ref, offsets_ref, lhs_ref, *refs):
        *weight_refs, out_ref = refs
        i = pl.program_id(0)
        n = pl.program_id(1)
        g = group_ref[i]

        @pl.when(g >= 0)
        def _():
            t = tile_ref[i]
            lo = offsets_ref[g]
            hi = offsets_ref[g + 1]
            row0 = pl.multiple_of(t * block_m, block_m)
            col0 = pl.multiple_of(n * block_n, block_n)
            acc = body(g, row0, col0, lhs_ref, *weight_refs)
            rows = row0 + jax.lax.broadcasted_iota(jnp.int32, (block_m, block_n), 0)
            pltriton.store(out_ref.at[pl.ds(row0, block_m), pl.ds(col0, block_n)], acc,
                           mask=(rows >= lo) & (rows < hi))

    return kernel


def launch(body, lhs, weights, group_sizes, N, *, block_m, block_n, num_warps, num_stages, interpret, name):
    """Pads lhs [M, K] to a multiple of block_m, lists the work items and runs `grouped_kernel(body)` over (items,
    N / block_n) with lhs and the `weights` arrays whole in memory -> [M, N] f32, rows past the groups 0 (no item
    writes them)."""
    M = lhs.shape[0]
    m_pad = -(-M // block_m) * block_m
    lhs_p = jnp.pad(lhs, ((0, m_pad - M), (0, 0))) if m_pad != M else lhs
    item_group, item_tile, offsets = work_items(group_sizes, M, block_m)
    extra = {}
    if not interpret:
        extra = dict(compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages))
    whole = lambda shape: pl.BlockSpec(shape, lambda i, n: (0,) * len(shape))
    operands = (item_group, item_tile, offsets, lhs_p) + tuple(weights)
    out = pl.pallas_call(
        grouped_kernel(body, block_m=block_m, block_n=block_n),
        grid=(item_group.shape[0], N // block_n),
        in_specs=[whole(x.shape) for x in operands],
        out_specs=whole((m_pad, N)),
        out_shape=jax.ShapeDtypeStruct((m_pad, N), jnp.float32),
        interpret=interpret, name=name, **extra,
    )(*operands)
    rows = jnp.arange(M, dtype=jnp.int32)[:, None]
    return jnp.where(rows < offsets[-1], out[:M], 0.0)


def _bf16_body(block_m, block_n, block_k, K):
    """The product over K in block_k steps, rhs [E, K, N] in lhs's dtype."""

    def body(g, row0, col0, lhs_ref, rhs_ref):
        def step(kk, acc):
            k0 = pl.multiple_of(kk * block_k, block_k)
            a = lhs_ref[pl.ds(row0, block_m), pl.ds(k0, block_k)]
            b = rhs_ref[g, pl.ds(k0, block_k), pl.ds(col0, block_n)]
            # f32 operands multiply in f32 (IEEE), not TF32, as the reference does (`reference.precision_for`)
            return acc + jnp.dot(a, b, precision=precision_for(a.dtype), preferred_element_type=jnp.float32)

        return jax.lax.fori_loop(0, K // block_k, step, jnp.zeros((block_m, block_n), jnp.float32))

    return body


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "num_warps", "num_stages",
                                             "interpret"))
def grouped_matmul_gpu(lhs, rhs, group_sizes, *, block_m=None, block_n=None, block_k=None, num_warps=None,
                       num_stages=None, interpret=False):
    """lhs [M, K], rhs [E, K, N], group_sizes [E] int32 -> [M, N] f32 (module doc). M is padded to a multiple of
    block_m inside; K and N must be multiples of block_k and block_n."""
    cfg = dict(DEFAULT_CONFIG)
    cfg.update({k: v for k, v in dict(block_m=block_m, block_n=block_n, block_k=block_k, num_warps=num_warps,
                                       num_stages=num_stages).items() if v is not None})
    M, K, E, N = check_operands(lhs, rhs, group_sizes)
    # a default block that does not divide the matrix narrows to one that does (tests, tiny configs); given ones
    # must divide
    bm = cfg["block_m"] or default_block_m(M)
    bn = cfg["block_n"] if block_n is not None else fit_block(cfg["block_n"], N, "N")
    bk = cfg["block_k"] if block_k is not None else fit_block(cfg["block_k"], K, "K")
    if K % bk or N % bn:
        raise ValueError(f"grouped_matmul: K = {K} must be a multiple of block_k = {bk} and N = {N} of block_n = "
                         f"{bn}")
    return launch(_bf16_body(bm, bn, bk, K), lhs, (rhs,), group_sizes, N, block_m=bm, block_n=bn,
                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], interpret=interpret,
                  name=f"grouped_matmul_m{bm}_n{bn}_k{bk}")
