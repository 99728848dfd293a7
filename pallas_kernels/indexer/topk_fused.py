"""The threshold top-k in one Triton kernel: one program per row, no launches between its stages.

    fused_select(scores [R, T] f32, k, capacity) -> (keys [R, k] int32, pos [R, k] int32)

The same exact selection as `topk.topk_threshold(impl="pallas_select")`, which runs it as a chain of XLA fusions and
four Triton kernels (group maxima, bound, survivor counts, compaction, overflow fix-up, k-set selection). Measured on
the H200 (session 7, 64 rows x 32768), that chain's stages each cost ~12-15 us at ~2 us of memory traffic: the
launches and the passes over the scores between them, not the work. Here one program per row runs:

  1. group maxima: the row's strided-group maxima (group g = entries g, g + G, ...; `topk._strided_group_max`) as a
     running max over the row read `rows_per_step` strided rows at a time, in registers [Gp];
  2. bound: tau = the k-th largest of the G maxima by a radix select in registers (`topk._radix_select_regs`);
  3. compaction: the survivors (key >= tau, above -inf's key) in ascending position into the row's `capacity` slots
     of a scratch output (a running offset + a block cumsum per chunk);
  4. overflow fix-up, only on a row with more than `capacity` survivors: its exact top-k set into slots [0, k)
     (`topk._fill_exact_row`);
  5. selection: the exact top-k set among the slots by a radix select, written in ascending position.
Stages 3-5 hand their slots on through global memory inside the program: a CTA barrier (`debug_barrier`, bar.sync)
between them makes one thread's stores visible to the others. The interpreter runs a program sequentially and needs
none.

Measured on the H200 (session 24, 64 rows x 32768, k = 512; `benchmarks/topk_stages.py`, results/h200_s24r*):
**not faster than the chain, so it is an option** (topk="threshold_fused" / "threshold_fused_set"), not a default.
Chain (threshold_set) 45-47 us, this kernel 48-53 us (every config swept), both with the ~10-14 us harness. The
stages inside one program, by cutting the kernel after each (`stop_after`), net of the harness:
  group maxima ~4-5 us | bound ~2.5 us | compaction ~20 us | selection ~9 us.
The compaction's block scans (cumsum) set the time: 16 scans of 2048 lanes (8 warps), 4 of 8192 (16 warps), one of
32768 (32 warps, 75 us in all) or the whole row resident in registers as one [32, 1024] tile with a scan along each
strided row (`resident`, 62 us in all) cost the same per element, ~1 element per cycle per SM. The chain's
compaction kernel spreads the same scans over R x 16 programs, which is why it wins despite its launches. The
radix selects are cheap by comparison: the bound's 16 passes over 1024 maxima take ~2.5 us, and neither the
[N, 2**bits] count matrix nor the early-exit loop (`topk._radix_select_regs`) moved the chain's time.
Output contract: `topk.select_pallas`'s (the set in ascending position, (INT32_MIN, 0) padding; with finite_only, the
non-finite picks left out).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .topk import (INT32_MIN, _compact_step, _fill_exact_row, _ordered_i32, _radix_select_regs, _survives,
                   _write_topk_set, threshold_layout)

try:
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover
    plgpu = None

__all__ = ["fused_select", "FUSED_KERNEL_CONFIG"]

# Launch and tile settings (swept with benchmarks/topk_stages.py --fused-configs, session 24: none beat these):
# warps per program, strided rows read per step of the group-maxima pass, chunk of the compaction pass, radix bits,
# count mode and early exit of the bound and the selection.
# num_stages: Triton's software pipelining of the two passes' loads (1 = none). stop_after (a diagnostic, 0 = the
# whole selection): end the kernel after stage 1, 2 or 3, writing that stage's result to pos[:, 0] (so the stages
# before it are not dead code) -- the time of the stages up to there, to see where a program's time goes.
# resident: a row of at most resident_max entries (as its [group, Gp] strided tile) is read once, into registers, and
# both the group maxima and the compaction work on it (one scan for the whole row instead of one per chunk).
FUSED_KERNEL_CONFIG = dict(num_warps=8, num_stages=1, rows_per_step=4, chunk=2048, bound_bits=2, select_bits=2,
                           matrix=True, early_exit=False, stop_after=0, resident=False, resident_max=32768)


def _barrier(interpret: bool):
    if not interpret:  # the interpreter runs a program's lanes in order: nothing to wait for
        plgpu.debug_barrier()


def _fused_kernel(scores_ref, slot_keys, slot_pos, keys_out, pos_out, *, T, k, kp, G, Gp, group, U, capacity, Cp,
                  chunk, bound_bits, select_bits, matrix, early_exit, finite_only, interpret, stop_after, resident):
    """One program = row r of scores_ref [R, T]: stages 1-5 of the module docstring. slot_keys / slot_pos [R,
    capacity + tail] are the row's survivor slots (scratch outputs); keys_out / pos_out [R, k + Cp] its k-set."""
    r = pl.program_id(0)
    glanes = jax.lax.iota(jnp.int32, Gp)

    def stop_here(stage, value):
        """stop_after == stage: write `value` (a scalar) as the row's only result."""
        if stop_after == stage:
            plgpu.store(pos_out.at[r, jax.lax.iota(jnp.int32, 2)], jnp.full((2,), value, jnp.int32))
        return stop_after == stage

    # 1. strided-group maxima: strided row j holds entries j * G + g; U of them per step (resident: all of them in
    # one [group, Gp] tile, kept in registers for the compaction)
    if resident:
        rows_ = jax.lax.iota(jnp.int32, group)
        cols2 = rows_[:, None] * G + glanes[None, :]
        ok2 = (glanes[None, :] < G) & (cols2 < T)
        key2 = _ordered_i32(plgpu.load(scores_ref.at[r, cols2], mask=ok2, other=-jnp.inf))
        gmax = jnp.max(jnp.where(ok2, key2, INT32_MIN), axis=0)

    def gmax_step(i, m):
        j = i * U + jax.lax.iota(jnp.int32, U)
        cols = j[:, None] * G + glanes[None, :]
        ok = (glanes[None, :] < G) & (cols < T)
        key = _ordered_i32(plgpu.load(scores_ref.at[r, cols], mask=ok, other=-jnp.inf))
        return jnp.maximum(m, jnp.max(jnp.where(ok, key, INT32_MIN), axis=0))

    if not resident:
        gmax = jax.lax.fori_loop(0, group // U, gmax_step, jnp.full((Gp,), INT32_MIN, jnp.int32))
    if stop_here(1, jnp.max(gmax)):
        return

    # 2. the bound: k <= 2k <= G, so the k-th largest maximum exists
    tau, _ = _radix_select_regs(gmax, glanes < G, jnp.int32(k), bound_bits, matrix, early_exit)
    if stop_here(2, tau):
        return

    # 3. compaction of the survivors into the slots, ascending position
    lanes = jax.lax.iota(jnp.int32, chunk)
    compact_step = lambda c, off: _compact_step(scores_ref, slot_keys, slot_pos, r, c * chunk, lanes, off, tau,
                                                T=T, capacity=capacity)

    if resident:   # position order = row-major over the tile: a scan along each strided row + the rows before it
        m2 = ok2 & _survives(key2, tau)
        mi2 = m2.astype(jnp.int32)
        per_row = jnp.sum(mi2, axis=1)
        at2 = (jnp.cumsum(per_row) - per_row)[:, None] + jnp.cumsum(mi2, axis=1) - 1
        ok = m2 & (at2 < capacity)
        at2 = jnp.where(ok, at2, capacity + rows_[:, None] * Gp + glanes[None, :])
        plgpu.store(slot_keys.at[r, at2], key2, mask=ok)
        plgpu.store(slot_pos.at[r, at2], cols2, mask=ok)
        n = jnp.sum(per_row)
    else:
        n = jax.lax.fori_loop(0, -(-T // chunk), compact_step, jnp.int32(0))
    if stop_here(3, n):
        return

    # 4. a row with more than `capacity` survivors: its exact top-k set in slots [0, k) instead
    @pl.when(n > capacity)
    def _():
        _barrier(interpret)   # the compaction's stores land before the fix-up overwrites those slots
        _fill_exact_row(r, tau, scores_ref, slot_keys, slot_pos, T=T, k=k, capacity=capacity, chunk=chunk,
                        bits=4)

    n = jnp.where(n > capacity, k, n)
    _barrier(interpret)

    # 5. the exact top-k set among the n slots (`topk._select_kernel`'s selection)
    slanes = jax.lax.iota(jnp.int32, Cp)
    key = plgpu.load(slot_keys.at[r, slanes], mask=slanes < n, other=INT32_MIN)
    pos = plgpu.load(slot_pos.at[r, slanes], mask=slanes < n, other=0)
    _write_topk_set(keys_out, pos_out, r, key, pos, slanes, n, k=k, kp=kp, bits=select_bits, matrix=matrix,
                    early_exit=early_exit, finite_only=finite_only)


def fused_select(scores, k: int, capacity: int | None = None, *, finite_only: bool = False, interpret: bool = False,
                 **config):
    """scores [R, T] float32 -> (keys [R, k], pos [R, k]) int32: the exact top-k set of each row (ties -> lower
    index, as lax.top_k) in ascending position, padded with (INT32_MIN, 0) past the row's picks; keys are the
    ordered-int32 keys (`topk._ordered_i32`). finite_only: non-finite picks (-inf, +inf, NaN) are left out, so the
    padding starts after the finite ones. One Triton kernel, one program per row. Needs the bounded layout of
    `topk.threshold_layout` (T > capacity, groups of >= 4); `config` overrides FUSED_KERNEL_CONFIG."""
    unknown = set(config) - set(FUSED_KERNEL_CONFIG)
    if unknown:
        raise ValueError(f"fused_select: unknown options {sorted(unknown)}; known: {sorted(FUSED_KERNEL_CONFIG)}")
    cfg = {**FUSED_KERNEL_CONFIG, **config}
    if scores.ndim != 2 or scores.dtype != jnp.float32:
        raise ValueError(f"fused_select: scores must be float32 [R, T], got {scores.dtype} {scores.shape}")
    R, T = scores.shape
    group, capacity = threshold_layout(T, k, capacity)
    if not (1 <= k <= capacity < T and group >= 4):
        raise ValueError(f"fused_select: needs 1 <= k ({k}) <= capacity ({capacity}) < T ({T}) and groups of >= 4 "
                         f"entries (got {group}); smaller rows take topk_threshold's lax.top_k shortcut")
    U, chunk = int(cfg["rows_per_step"]), int(cfg["chunk"])
    if U & (U - 1) or chunk & (chunk - 1) or U > group:
        raise ValueError(f"fused_select: rows_per_step ({U}) and chunk ({chunk}) must be powers of two, "
                         f"rows_per_step <= group ({group})")
    if int(cfg["stop_after"]) not in (0, 1, 2, 3):
        raise ValueError(f"fused_select: stop_after must be 0 (the whole selection) or a stage 1-3, got "
                         f"{cfg['stop_after']}")
    for b in ("bound_bits", "select_bits"):
        if 32 % int(cfg[b]):
            raise ValueError(f"fused_select: {b} ({cfg[b]}) must divide 32")
    G = -(-T // group)
    Gp = 1 << (G - 1).bit_length()
    Cp = 1 << (capacity - 1).bit_length()
    kp = 1 << (k - 1).bit_length()
    resident = bool(cfg["resident"]) and group * Gp <= int(cfg["resident_max"])
    kernel = functools.partial(
        _fused_kernel, T=T, k=k, kp=kp, G=G, Gp=Gp, group=group, U=U, capacity=capacity, Cp=Cp, chunk=chunk,
        bound_bits=int(cfg["bound_bits"]), select_bits=int(cfg["select_bits"]), matrix=bool(cfg["matrix"]),
        early_exit=bool(cfg["early_exit"]), finite_only=finite_only, interpret=interpret,
        stop_after=int(cfg["stop_after"]), resident=resident)
    full = lambda shape: pl.BlockSpec(shape, lambda i: (0,) * len(shape))
    extra = {} if interpret else dict(
        compiler_params=plgpu.CompilerParams(num_warps=int(cfg["num_warps"]), num_stages=int(cfg["num_stages"])))
    slots = capacity + max(chunk, Cp, group * Gp if resident else 0)      # + the tail lanes not stored write to
    outs = pl.pallas_call(
        kernel, grid=(R,), in_specs=[full((R, T))],
        out_specs=[full((R, slots))] * 2 + [full((R, k + Cp))] * 2,
        out_shape=[jax.ShapeDtypeStruct((R, slots), jnp.int32)] * 2
        + [jax.ShapeDtypeStruct((R, k + Cp), jnp.int32)] * 2,
        interpret=interpret, name="topk_fused", **extra,
    )(scores)
    return outs[2][:, :k], outs[3][:, :k]
