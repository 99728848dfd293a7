"""Exact top-k set of each row by a histogram radix select spread over several programs per row: three Triton
kernels, no block-wide scan over a whole row. The GPU top-k of `topk_threshold(impl="pallas_mhist")` (indexer
topk="mhist" / "mhist_set").

    mhist_select(scores [R, T] f32, k, *, row_max=None, group_max=None, interpret=False)
        -> pos [R, k] int32   the index set, ascending position, -1 padding (picks with a non-finite score left out)

Contract: the same set as `hist_select(scores, k, finite_only=True, set_out=True)`, i.e. the k-set of
`topk_from_scores(scores, k, topk="lax")` (ties -> lower index) over XLA's float total order, in index order.

Why. `topk_hist` selects a row in one program: ~32 us for 64 x 32K on the H200, because one SM per row reads the
row at a fraction of the HBM bandwidth (the max alone ~4.7 us) and block scans in one program are slow. The
threshold chain (`topk.py`) spreads rows over 16 programs but runs ~9 launches. Here a row is cut into C chunks
(C programs per row) and the selection takes three launches:

  K1 (R x C programs): the log-binned histogram (`topk_hist.pass1_bin`, 64 bins per octave) of the distances
     d = M - key of the chunk's valid entries, M = the row's largest key (from the scores kernel's group maxima,
     `group_max`, or one XLA reduction). Writes hist [R, C, 2048] and a flag when the chunk holds a key above M
     or M is not finite (the slow path's rows).
  K2 (R x C programs): sums the row's C histograms, finds the bin b of the k-th smallest d (`_pick_bin`): every
     entry in a lower bin is picked ("above": fewer than k), the entries in b are the boundary (usually 5-45 of
     them for 32K-262K scores, of which a few are needed). From the per-chunk counts below b and in b, each
     program knows where its chunk's entries go: it writes its above entries at their final rank in index order
     (a two-level running count over its tile), and its boundary entries (distance and position) into a short
     per-row list of `cap` slots, also in index order.
  K3 (R programs): ranks the boundary list by (d, position), keeps the `need` = k - #above best, and merges them
     into the above list by position: one [cap, cap] and one [k, cap] comparison, no scan over the row. A row
     whose boundary overflows the list, whose chunks raised the flag, or whose scores include +inf / NaN takes the
     slow path inside the same program: `topk_hist`'s whole one-program selection over the row.

Rows with fewer than k valid entries (above -inf's key) pick all of them (b past the last bin), the rest -1.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .histogram import histogram
from .topk import INT32_MIN, NEG_INF_KEY, POS_INF_KEY, _ordered_i32
from .topk_hist import BINS, HIST_KERNEL_CONFIG, _hist_kernel, _pick_bin, pass1_bin

try:
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover
    plgpu = None

__all__ = ["mhist_select", "mhist_slow_rows", "MHIST_KERNEL_CONFIG", "mhist_layout"]

# chunk: entries per K1 / K2 program (a power of two; raised until a row has at most max_chunks chunks), tile: the
# entries one program holds in registers at a time, cap: boundary slots per row (K3's comparisons are cap x cap
# and k x cap), warps per kernel. slow: 0 is a timing probe (K3 without its slow path: wrong results for the rows
# that need it). Not yet swept on the H200.
MHIST_KERNEL_CONFIG = dict(chunk=8192, tile=8192, max_chunks=8, cap=128, warps1=8, warps2=8, warps3=16, slow=1)


def _u32(x):
    return jax.lax.bitcast_convert_type(x, jnp.uint32)


def _i32(x):
    return jax.lax.bitcast_convert_type(x, jnp.int32)


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def mhist_layout(T: int, cfg=None):
    """(chunk, tile, C): entries per program, per register tile, and programs per row for rows of T entries."""
    cfg = MHIST_KERNEL_CONFIG if cfg is None else cfg
    chunk = max(int(cfg["chunk"]), _pow2(-(-T // int(cfg["max_chunks"]))))
    chunk = min(chunk, _pow2(T))
    tile = min(int(cfg["tile"]), chunk)
    if chunk & (chunk - 1) or tile & (tile - 1):
        raise ValueError(f"mhist: chunk ({chunk}) and tile ({tile}) must be powers of two")
    return chunk, tile, -(-T // chunk)


def _tiles(scores_ref, r, c, *, T, chunk, tile, fn, init):
    """fn(key [tile] int32, cols [tile] int32, lanes, carry) -> carry over chunk c's tiles (keys of cols >= T: -inf's,
    i.e. invalid)."""
    lanes = jax.lax.iota(jnp.int32, tile)

    def step(t, carry):
        cols = c * chunk + t * tile + lanes
        x = plgpu.load(scores_ref.at[r, cols], mask=cols < T, other=-jnp.inf)
        return fn(_ordered_i32(x), cols, lanes, carry)

    n = chunk // tile
    return step(0, init) if n == 1 else jax.lax.fori_loop(0, n, step, init)


def _k1_hist(m_ref, scores_ref, hist_ref, flag_ref, *, T, chunk, tile, from_groups, P, G, Pp, Gp):
    r, c = pl.program_id(0), pl.program_id(1)
    if from_groups:   # M = the max of the row's partial group maxima [P, G] (ordered keys)
        pi, gi = jax.lax.iota(jnp.int32, Pp), jax.lax.iota(jnp.int32, Gp)
        part = plgpu.load(m_ref.at[r, pi[:, None], gi[None, :]], mask=(pi[:, None] < P) & (gi[None, :] < G),
                          other=INT32_MIN)
        m = jnp.max(part)
    else:
        m = m_ref[r]
    um = _u32(m ^ jnp.int32(INT32_MIN))

    def count(key, cols, lanes, carry):
        hist, top = carry
        valid = (key > NEG_INF_KEY) & (key <= m)
        d = um - _u32(key ^ jnp.int32(INT32_MIN))
        top = jnp.maximum(top, jnp.max(jnp.where(key > NEG_INF_KEY, key, INT32_MIN)))
        return hist + histogram(pass1_bin(d), BINS, mask=valid), top

    hist, top = _tiles(scores_ref, r, c, T=T, chunk=chunk, tile=tile, fn=count,
                       init=(jnp.zeros((BINS,), jnp.int32), jnp.int32(INT32_MIN)))
    plgpu.store(hist_ref.at[r, c, jax.lax.iota(jnp.int32, BINS)], hist)
    bad = (top > m) | (m >= POS_INF_KEY)
    flag_ref[r, c] = bad.astype(jnp.int32)


def _k2_place(m_ref, hist_ref, scores_ref, above_ref, bnd_d_ref, bnd_pos_ref, meta_ref, *, T, k, kp, chunk, tile, C,
              Cp, cap, from_groups, P, G, Pp, Gp, dump):
    r, c = pl.program_id(0), pl.program_id(1)
    ci, bi = jax.lax.iota(jnp.int32, Cp), jax.lax.iota(jnp.int32, BINS)
    hist = plgpu.load(hist_ref.at[r, ci[:, None], bi[None, :]], mask=ci[:, None] < C, other=0)   # [Cp, BINS]
    b, below, in_bin = _pick_bin(jnp.sum(hist, axis=0), jnp.int32(k))
    take_all = b >= BINS                       # fewer than k valid entries: all of them, no boundary
    above_c = jnp.sum(jnp.where(bi[None, :] < b, hist, 0), axis=1)                 # [Cp] per-chunk counts
    bnd_c = jnp.sum(jnp.where(bi[None, :] == b, hist, 0), axis=1)
    off_a0 = jnp.sum(jnp.where(ci < c, above_c, 0))
    off_b0 = jnp.sum(jnp.where(ci < c, bnd_c, 0))
    if from_groups:
        pi, gi = jax.lax.iota(jnp.int32, Pp), jax.lax.iota(jnp.int32, Gp)
        m = jnp.max(plgpu.load(m_ref.at[r, pi[:, None], gi[None, :]], mask=(pi[:, None] < P) & (gi[None, :] < G),
                               other=INT32_MIN))
    else:
        m = m_ref[r]
    um = _u32(m ^ jnp.int32(INT32_MIN))
    sh = int(k).bit_length()                   # the above count (< k) in the low bits of one packed running count

    def place(key, cols, lanes, carry):
        off_a, off_b = carry
        rows = tile // 16
        key, cols, lanes = (v.reshape(rows, 16) for v in (key, cols, lanes))
        valid = (key > NEG_INF_KEY) & (key <= m)
        binned = pass1_bin(um - _u32(key ^ jnp.int32(INT32_MIN)))
        above = valid & (take_all | (binned < b))
        bnd = valid & ~take_all & (binned == b)
        p = above.astype(jnp.int32) + (bnd.astype(jnp.int32) << sh)
        row_sums = jnp.sum(p, axis=1)
        row_cum = jnp.cumsum(row_sums)
        run = jnp.cumsum(p, axis=1) + (row_cum - row_sums)[:, None]   # inclusive running count, two levels
        total = jnp.max(row_cum)
        at_a = off_a + (run & ((1 << sh) - 1)) - 1
        at_b = off_b + (run >> sh) - 1
        ok_a = above & (at_a < kp)
        ok_b = bnd & (at_b < cap)
        at_a = jnp.where(ok_a, at_a, (kp + lanes) if dump else 0)
        at_b = jnp.where(ok_b, at_b, (cap + lanes) if dump else 0)
        plgpu.store(above_ref.at[r, at_a], cols, mask=ok_a)
        dist = _i32(um - _u32(key ^ jnp.int32(INT32_MIN)))
        plgpu.store(bnd_d_ref.at[r, at_b], dist, mask=ok_b)
        plgpu.store(bnd_pos_ref.at[r, at_b], cols, mask=ok_b)
        return off_a + (total & ((1 << sh) - 1)), off_b + (total >> sh)

    _tiles(scores_ref, r, c, T=T, chunk=chunk, tile=tile, fn=place, init=(off_a0, off_b0))
    mi = jax.lax.iota(jnp.int32, 4)
    meta = jnp.where(mi == 0, below, jnp.where(mi == 1, in_bin, take_all.astype(jnp.int32)))
    plgpu.store(meta_ref.at[r, mi], meta, mask=(mi < 3) & (c == 0))


def _k3_merge(meta_ref, flag_ref, above_ref, bnd_d_ref, bnd_pos_ref, scores_ref, out_ref, *, k, kp, C, Cp, cap, dump,
              slow):
    r = pl.program_id(0)
    ci = jax.lax.iota(jnp.int32, Cp)
    flagged = jnp.max(plgpu.load(flag_ref.at[r, ci], mask=ci < C, other=0)) > 0
    below = meta_ref[r, 0]
    in_bin = meta_ref[r, 1]
    take_all = meta_ref[r, 2] > 0
    overflow = flagged | (~take_all & (in_bin > cap))

    def fast():
        need = jnp.where(take_all, 0, k - below)
        al = jax.lax.iota(jnp.int32, kp)
        bl = jax.lax.iota(jnp.int32, cap)
        a_ok = al < below
        apos = plgpu.load(above_ref.at[r, al], mask=a_ok, other=2 ** 31 - 1)
        b_ok = (bl < in_bin) & ~take_all
        bd = _u32(plgpu.load(bnd_d_ref.at[r, bl], mask=b_ok, other=-1))
        bpos = plgpu.load(bnd_pos_ref.at[r, bl], mask=b_ok, other=2 ** 31 - 1)
        # rank of boundary entry i: entries j (valid) with a smaller distance, or the same one earlier in the list
        # (the list is in index order: ties -> lower index)
        before = (bd[None, :] < bd[:, None]) | ((bd[None, :] == bd[:, None]) & (bl[None, :] < bl[:, None]))
        rank = jnp.sum((before & b_ok[None, :]).astype(jnp.int32), axis=1)
        pick = b_ok & (rank < need)
        # merge by position: above entry i moves past the picks before it; pick j past the above entries before it
        lt = (bpos[None, :] < apos[:, None]) & a_ok[:, None]                       # [kp, cap]
        shift = jnp.sum((lt & pick[None, :]).astype(jnp.int32), axis=1)
        n_before = jnp.sum(((apos[:, None] < bpos[None, :]) & a_ok[:, None]).astype(jnp.int32), axis=0)
        pick_i = pick.astype(jnp.int32)
        at_p = jnp.cumsum(pick_i) - 1 + n_before
        at_a = jnp.where(a_ok, al + shift, (k + al) if dump else 0)
        at_p = jnp.where(pick, at_p, (k + bl) if dump else 0)
        plgpu.store(out_ref.at[r, at_a], apos, mask=a_ok)
        plgpu.store(out_ref.at[r, at_p], bpos, mask=pick)
        n_out = below + jnp.sum(pick_i)
        pad = (al >= n_out) & (al < k)
        plgpu.store(out_ref.at[r, jnp.where(pad, al, (k + al) if dump else 0)], jnp.full((kp,), -1, jnp.int32),
                    mask=pad)

    if slow is None:     # timing probe
        return fast()
    jax.lax.cond(overflow, lambda: slow(scores_ref, out_ref, row=r), fast)


def mhist_select(scores, k: int, *, row_max=None, group_max=None, interpret: bool = False, config=None):
    """scores [R, T] float32 -> pos [R, k] int32: each row's exact top-k set in ascending position, -1 padding,
    picks with a non-finite score left out (see module doc). 1 <= k <= T.

    The row maximum M of the ordered keys (`topk._ordered_i32`): group_max [R, P, G] int32 (partial group maxima of
    the keys, as the indexer scores kernel writes them; their max is M), or row_max [R] int32, or neither (one XLA
    reduction). A wrong M is safe: chunks holding a larger key raise the flag and the row takes the slow path."""
    return _mhist(scores, k, row_max=row_max, group_max=group_max, interpret=interpret, config=config)[0]


def mhist_slow_rows(scores, k: int, **kw):
    """bool [R]: the rows `mhist_select` sends to its slow path (flagged chunks or a boundary past `cap`); for
    tests and diagnostics."""
    return _mhist(scores, k, **kw)[1]


def _mhist(scores, k: int, *, row_max=None, group_max=None, interpret: bool = False, config=None):
    R, T = scores.shape
    if not 1 <= k <= T:
        raise ValueError(f"mhist_select: need 1 <= k ({k}) <= T ({T})")
    if T >= 2 ** 30:
        raise ValueError(f"mhist_select: T = {T} too large")
    cfg = dict(MHIST_KERNEL_CONFIG, **(config or {}))
    chunk, tile, C = mhist_layout(T, cfg)
    if tile < 16:
        tile = chunk = 16 if T >= 16 else chunk
        C = -(-T // chunk)
    cap = _pow2(int(cfg["cap"]))
    kp, Cp = _pow2(k), _pow2(C)
    scores = scores.astype(jnp.float32)
    if group_max is not None:
        if group_max.ndim != 3 or group_max.shape[0] != R or group_max.dtype != jnp.int32:
            raise ValueError(f"mhist_select: group_max must be int32 [{R}, P, G], got {group_max.dtype} "
                             f"{group_max.shape}")
        m_arg, from_groups = group_max, True
        P, G = group_max.shape[1:]
    else:
        if row_max is None:
            keys = _ordered_i32(scores)
            row_max = jnp.max(jnp.where(keys > NEG_INF_KEY, keys, INT32_MIN), axis=1)
        if row_max.shape != (R,) or row_max.dtype != jnp.int32:
            raise ValueError(f"mhist_select: row_max must be int32 [{R}], got {row_max.dtype} {row_max.shape}")
        m_arg, from_groups, P, G = row_max, False, 1, 1
    mkw = dict(from_groups=from_groups, P=P, G=G, Pp=_pow2(P), Gp=_pow2(G))
    params = (lambda w: {}) if interpret else (lambda w: dict(compiler_params=plgpu.CompilerParams(
        num_warps=int(w), num_stages=1)))
    full = lambda shape: pl.BlockSpec(shape, lambda *i: (0,) * len(shape))
    sds = jax.ShapeDtypeStruct
    dump = bool(interpret)     # interpreter: masked-off lanes store into a tail past the real slots
    hist, flag = pl.pallas_call(
        functools.partial(_k1_hist, T=T, chunk=chunk, tile=tile, **mkw),
        grid=(R, C), in_specs=[full(m_arg.shape), full((R, T))],
        out_specs=[full((R, C, BINS)), full((R, C))],
        out_shape=[sds((R, C, BINS), jnp.int32), sds((R, C), jnp.int32)],
        interpret=interpret, name="topk_mhist_count", **params(cfg["warps1"]),
    )(m_arg, scores)
    tail = tile if dump else 0
    above, bnd_d, bnd_pos, meta = pl.pallas_call(
        functools.partial(_k2_place, T=T, k=k, kp=kp, chunk=chunk, tile=tile, C=C, Cp=Cp, cap=cap, dump=dump, **mkw),
        grid=(R, C), in_specs=[full(m_arg.shape), full((R, C, BINS)), full((R, T))],
        out_specs=[full((R, kp + tail)), full((R, cap + tail)), full((R, cap + tail)), full((R, 4))],
        out_shape=[sds((R, kp + tail), jnp.int32), sds((R, cap + tail), jnp.int32), sds((R, cap + tail), jnp.int32),
                   sds((R, 4), jnp.int32)],
        interpret=interpret, name="topk_mhist_place", **params(cfg["warps2"]),
    )(m_arg, hist, scores)
    # the slow path: topk_hist's one-program selection of the row (its own max, passes and index-order writes)
    hcfg = HIST_KERNEL_CONFIG
    h_chunk = min(int(hcfg["chunk"]), _pow2(T))
    h_tiles = -(-T // h_chunk)
    slow = functools.partial(_hist_kernel, T=T, k=k, kp=kp, chunk=h_chunk, n_tiles=h_tiles,
                             resident=bool(hcfg["resident"]) and h_tiles == 1, finite_only=True, set_out=True,
                             tail=dump, stop_after=3, scan2d=bool(hcfg["scan2d"]) and h_chunk >= 32,
                             refine=int(hcfg["refine"]))
    width = k + max(h_chunk, kp, cap) if dump else k
    out = pl.pallas_call(
        functools.partial(_k3_merge, k=k, kp=kp, C=C, Cp=Cp, cap=cap, dump=dump, slow=slow if cfg["slow"] else None),
        grid=(R,), in_specs=[full((R, 4)), full((R, C)), full((R, kp + tail)), full((R, cap + tail)),
                             full((R, cap + tail)), full((R, T))],
        out_specs=full((R, width)), out_shape=sds((R, width), jnp.int32),
        interpret=interpret, name="topk_mhist_merge", **params(cfg["warps3"]),
    )(meta, flag, above, bnd_d, bnd_pos, scores)
    slow_rows = (jnp.max(flag, axis=1) > 0) | ((meta[:, 2] == 0) & (meta[:, 1] > cap))
    return (out[:, :k] if dump else out), slow_rows
