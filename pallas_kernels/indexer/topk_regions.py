"""The threshold top-k in two Triton kernels: bound + compaction into per-chunk regions, then selection.

    regions_select(scores [R, T] f32, group_max [R, P, G] int32, k, capacity) -> (keys [R, k], pos [R, k]) int32

The same exact selection as `topk.topk_threshold(impl="pallas_select")` (topk="threshold_set"'s chain until session
30), with fewer launches. On the H200 (session 30, `benchmarks/indexer_kernels.py`, B = 64 rows x 32768 scores,
k = 512) that chain's kernels took, in CUPTI time per call: the XLA group maxima 6.8 us, `topk_bound` 5.3, the XLA
survivor counts 2.8, `topk_compact` 7.8, `topk_exact_rows` 1.2, `topk_select` 9.7, and four small XLA fusions of
1.1-1.8 us each (n, min(n, capacity), ...): ~39 us for ~2 us of memory traffic. Every launch costs >= ~1 us of
GPU time even when it has nothing to do. Here:

  1. `bound_compact` (grid rows x chunks, <= 16 chunks a row): each program takes the row's group maxima (the max
     over P partials: the Mosaic scores kernel's per-CTA maxima, or one XLA pass), computes the bound tau = their
     k-th largest by a radix select in registers (every program of the row the same, redundantly: cheaper than a
     launch), and compacts its chunk's survivors (key >= tau, above -inf's key) in ascending position into its own
     region of the slot buffers: region c = slots [c * cap_c, (c + 1) * cap_c), cap_c = min(chunk, capacity). No
     offsets from earlier chunks are needed, so no counting pass before it. It writes the chunk's survivor count.
  2. `select_regions` (one program per row): n = the sum of the counts. A row with n <= capacity reads its survivors
     back in ascending position (lane i -> the chunk whose running count covers i, at its offset in that region);
     a row with n > capacity (heavy ties, adversarial layouts) gets its exact top-k set from the row itself
     (`topk._fill_exact_row`, the same fix-up as the chain's) first. Then the exact top-k set among those slots by
     a radix select (`topk._write_topk_set`), written in ascending position.
A row overflows here exactly when it overflows in the chain (n > capacity), and a chunk whose count exceeds its
region (only possible when chunk > capacity) makes n > capacity too, so its truncated region is never read.
Output contract: `topk.select_pallas`'s (the set in ascending position, (INT32_MIN, 0) padding; with finite_only,
the non-finite picks left out).

Measured on the H200 (session 30, B = 64 x 32768 scores, CUPTI, results/h200_s30r3_ikern.log): **slower than the
chain, so an option** (topk="threshold_regions" / "threshold_regions_set"): `topk_bound_compact` 18.9 us (the
chain's bound + counts + compaction: 15.8; every chunk's program repeats the 1024-lane radix select) and
`topk_select_regions` 37.6 us (the chain's selection: 9.7; the fix-up compiled into the same kernel and the region
gather); the whole indexer call 159.3 vs 136.2 us.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .topk import INT32_MIN, SELECT_KERNEL_CONFIG, _compact_step, _fill_exact_row, _row_bound, _write_topk_set

try:
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover
    plgpu = None

__all__ = ["regions_select", "REGIONS_CONFIG", "regions_layout"]

# warps of the two kernels, the compaction's sub-step (lanes scanned at once) and most chunks per row
REGIONS_CONFIG = dict(compact_warps=4, select_warps=8, sub=1024, max_chunks=16, min_chunk=2048, fix_chunk=1024,
                      fix_bits=4)


def regions_layout(T: int, capacity: int, max_chunks: int | None = None, min_chunk: int | None = None):
    """(chunk, n_chunks, cap_c) for rows of T scores: power-of-two chunks of >= min_chunk scores, at most max_chunks
    of them (so the selection's lane -> chunk map stays a small [lanes, chunks] compare), regions of
    cap_c = min(chunk, capacity) slots."""
    max_chunks = max_chunks or REGIONS_CONFIG["max_chunks"]
    min_chunk = min_chunk or REGIONS_CONFIG["min_chunk"]
    chunk = max(min_chunk, 1 << (-(-T // max_chunks) - 1).bit_length())
    return chunk, -(-T // chunk), min(chunk, capacity)


def _bound_compact_kernel(gmax_ref, scores_ref, keys_out, pos_out, counts_out, tau_out, *, P, G, Gp, k, bits, T,
                          chunk, sub, cap_c, tail, matrix, early_exit):
    """Program (r, c): tau of row r from its group maxima, then chunk c's survivors into region c (ascending
    position; those past cap_c are dropped: their row has n > capacity). counts_out[r, c] = the chunk's survivors,
    tau_out[r, c] = tau (the same for every c)."""
    r, c = pl.program_id(0), pl.program_id(1)
    tau = _row_bound(gmax_ref, r, P=P, G=G, Gp=Gp, k=k, bits=bits, matrix=matrix, early_exit=early_exit)
    lanes = jax.lax.iota(jnp.int32, sub)
    # region c = slots [c * cap_c, (c + 1) * cap_c); the lanes not stored go to the tail past every region
    step = lambda j, off: _compact_step(scores_ref, keys_out, pos_out, r, c * chunk + j * sub, lanes, off, tau, T=T,
                                        capacity=cap_c, base=c * cap_c, tail=tail)
    n = jax.lax.fori_loop(0, chunk // sub, step, jnp.int32(0))
    counts_out[...] = jnp.full((1, 1), n, jnp.int32)
    tau_out[...] = jnp.full((1, 1), tau, jnp.int32)


def _select_regions_kernel(counts_ref, tau_ref, scores_ref, keys_ref, pos_ref, fix_keys, fix_pos, keys_out, pos_out,
                           *, T, k, kp, NC, NCp, Cp, cap_c, capacity, bits, fix_chunk, fix_bits, matrix, early_exit,
                           finite_only, interpret):
    """Program r: the exact top-k set of row r among its region slots (or, n > capacity, among the k slots the
    fix-up writes), in ascending position, into keys_out / pos_out [R, k + Cp]."""
    r = pl.program_id(0)
    ci = jax.lax.iota(jnp.int32, NCp)
    cnt = plgpu.load(counts_ref.at[r, ci], mask=ci < NC, other=0)
    n = jnp.sum(cnt)
    over = n > capacity

    @pl.when(over)
    def _():
        _fill_exact_row(r, tau_ref[r, 0], scores_ref, fix_keys, fix_pos, T=T, k=k, capacity=capacity,
                        chunk=fix_chunk, bits=fix_bits)
        if not interpret:   # the fix-up's stores land before this program's threads read them back
            plgpu.debug_barrier()

    slanes = jax.lax.iota(jnp.int32, Cp)
    incl = jnp.cumsum(cnt)
    excl = incl - cnt
    ch = jnp.sum((incl[None, :] <= slanes[:, None]).astype(jnp.int32), axis=1)         # lane -> its chunk
    start = jnp.sum(jnp.where(ch[:, None] == ci[None, :], excl[None, :], 0), axis=1)   # that chunk's first lane
    slot = ch * cap_c + slanes - start
    from_regions = (slanes < n) & jnp.logical_not(over)
    from_fix = (slanes < k) & over
    key = jnp.where(over, plgpu.load(fix_keys.at[r, slanes], mask=from_fix, other=INT32_MIN),
                    plgpu.load(keys_ref.at[r, jnp.where(from_regions, slot, 0)], mask=from_regions, other=INT32_MIN))
    pos = jnp.where(over, plgpu.load(fix_pos.at[r, slanes], mask=from_fix, other=0),
                    plgpu.load(pos_ref.at[r, jnp.where(from_regions, slot, 0)], mask=from_regions, other=0))
    _write_topk_set(keys_out, pos_out, r, key, pos, slanes, jnp.where(over, k, n), k=k, kp=kp, bits=bits,
                    matrix=matrix, early_exit=early_exit, finite_only=finite_only)


def regions_select(scores, group_max, k: int, capacity: int, *, finite_only: bool = False, interpret: bool = False):
    """scores [R, T] float32, group_max [R, P, G] int32 (partial maxima of the ordered keys of the strided groups of
    `topk.threshold_layout`; their max over P is the group maxima) -> (keys [R, k], pos [R, k]) int32: the exact
    top-k set of each row (ties -> lower index, as lax.top_k) in ascending position, padded with (INT32_MIN, 0)
    past the row's picks (finite_only: the non-finite picks left out first). Two Triton kernels (module doc)."""
    R, T = scores.shape
    P, G = group_max.shape[1:]
    if group_max.shape[0] != R or group_max.dtype != jnp.int32 or not 1 <= k <= min(G, capacity) or capacity >= T:
        raise ValueError(f"regions_select: need group_max int32 [R={R}, P, G >= k], 1 <= k ({k}) <= capacity "
                         f"({capacity}) < T ({T}); got group_max {group_max.dtype} {group_max.shape}")
    cfg = REGIONS_CONFIG
    chunk, NC, cap_c = regions_layout(T, capacity)
    sub = min(int(cfg["sub"]), chunk)
    tail = NC * cap_c
    Gp = 1 << (G - 1).bit_length()
    NCp = max(2, 1 << (NC - 1).bit_length())
    Cp = 1 << (capacity - 1).bit_length()
    kp = 1 << (k - 1).bit_length()
    fix_chunk = int(cfg["fix_chunk"])
    bits = SELECT_KERNEL_CONFIG["bound_bits"]
    matrix, early_exit = bool(SELECT_KERNEL_CONFIG["bound_matrix"]), bool(SELECT_KERNEL_CONFIG["early_exit"])
    full2 = lambda shape: pl.BlockSpec(shape, lambda i, j: (0,) * len(shape))
    one = pl.BlockSpec((1, 1), lambda i, j: (i, j))
    params = lambda w: {} if interpret else dict(compiler_params=plgpu.CompilerParams(num_warps=int(w), num_stages=1))
    keys_s, pos_s, counts, taus = pl.pallas_call(
        functools.partial(_bound_compact_kernel, P=P, G=G, Gp=Gp, k=k, bits=bits, T=T, chunk=chunk, sub=sub,
                          cap_c=cap_c, tail=tail, matrix=matrix, early_exit=early_exit),
        grid=(R, NC), in_specs=[full2((R, P, G)), full2((R, T))],
        out_specs=[full2((R, tail + sub))] * 2 + [one] * 2,
        out_shape=[jax.ShapeDtypeStruct((R, tail + sub), jnp.int32)] * 2
        + [jax.ShapeDtypeStruct((R, NC), jnp.int32)] * 2,
        interpret=interpret, name="topk_bound_compact", **params(cfg["compact_warps"]),
    )(group_max, scores)
    full1 = lambda shape: pl.BlockSpec(shape, lambda i: (0,) * len(shape))
    fix_w = capacity + fix_chunk
    outs = pl.pallas_call(
        functools.partial(_select_regions_kernel, T=T, k=k, kp=kp, NC=NC, NCp=NCp, Cp=Cp, cap_c=cap_c,
                          capacity=capacity, bits=SELECT_KERNEL_CONFIG["select_bits"], fix_chunk=fix_chunk,
                          fix_bits=int(cfg["fix_bits"]), matrix=bool(SELECT_KERNEL_CONFIG["select_matrix"]),
                          early_exit=early_exit, finite_only=finite_only, interpret=interpret),
        grid=(R,), in_specs=[full1((R, NC)), full1((R, NC)), full1((R, T)), full1((R, tail + sub)),
                             full1((R, tail + sub))],
        out_specs=[full1((R, fix_w))] * 2 + [full1((R, k + Cp))] * 2,
        out_shape=[jax.ShapeDtypeStruct((R, fix_w), jnp.int32)] * 2 + [jax.ShapeDtypeStruct((R, k + Cp), jnp.int32)] * 2,
        interpret=interpret, name="topk_select_regions", **params(cfg["select_warps"]),
    )(counts, taus, scores, keys_s, pos_s)
    return outs[2][:, :k], outs[3][:, :k]
