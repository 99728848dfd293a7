"""Exact top-k set of each row in one Triton program: radix select with 11-bit histogram digits, then the set
written in index order. The GPU top-k of `topk_threshold(impl="pallas_hist")` (indexer topk="hist" / "hist_set"),
and as a tournament over segments of each row, `topk_threshold(impl="pallas_tour")` (topk="tour" / "tour_set").

    hist_select(scores [R, T] f32, k, *, finite_only=False, set_out=False, chunk=None, num_warps=None,
                seg_len=None, posmap=None, slack=0, interpret=False)
        -> (keys [R, k] int32, pos [R, k] int32)   ascending position, padding (INT32_MIN, 0) past the picks
        -> pos [R, k] int32                         set_out: the index set itself, -1 padding (needs finite_only)
    tournament_select(scores [R, T], k, *, finite_only=False, set_out=False, fuse_final=None, ...) -> the same results
    tournament_last_stage(scores, k, posmap=None, ...) -> the same results (the last segment stage + the final
                                                          selection in one kernel; fuse_final)

The tournament (session 36). One program per row leaves most of the GPU idle when a call has few rows (64 rows on
132 SMs, 1 row at batch 1), and one SM works through the whole row. `tournament_select` cuts each row into segments
of 4096 candidates, one program each (`seg_len`), which keep a superset of their own top-k set (k + 64 slots:
`slack`, so a segment skips its refining pass when the k-th's pass-1 bin fits); the survivors, still in ascending
position, go through the same kernel again until a row holds <= 8192 of them, and one program per row selects the
exact set among those (`posmap` carries the positions through). Every entry of the row's top k is among its
segment's top k, so the result is the same k-set, ties included. With `fuse_final` (session 38; correct on the H200 but
slower, so off: `TOUR_CONFIG`) the last segment stage and the final selection are one kernel: each segment program
publishes its survivors through an atomic arrival count per row, and the row's program that arrives last selects
the row's set, so rows that finish early overlap their final selection with other rows' segments, and the final
kernel's launch and the gap before it go. H200 (benchmarks/results/README_indexer_compressor.md,
session 36), whole fp8 indexer calls: B = 64 x 128K 135.0 -> 124.9 us, B = 16 x 128K 73.5 -> 50.0, B = 1 x 128K
34.3 -> 24.7, B = 1 x 1M 46.0 -> 41.7; slower than the chain where a call has more than ~2^21 candidates (64 x 1M
rows: 218 vs 156 us in topk_stages), and than one program per row at 128 x 32768.

Contract: the same k-set as `topk_from_scores(scores, k, topk="lax")` (ties -> lower index) over XLA's float total
order (`_ordered_i32` keys), for every input; finite_only leaves out picks whose score is not finite.

Why one program per row, and why histograms. The threshold chain (`topk.py`) spreads a row over 16 compaction
programs, but pays for it in launches: bound, counts, compaction, fix-up and selection kernels plus XLA glue, ~35 us
of GPU time for 64 x 32K candidates on the H200, most of it the latency of small steps. A radix select needs few
steps only if a step fixes many bits: the chain's in-register selects fix 2 bits per block-wide reduction (16
passes), while one `histogram` (`histogram.py`: shared-memory atomics, one per element) counts all 2048 values of an
11-bit digit at once. Per row (all in one program):

  0. M = the largest valid key (valid: above -inf's key; entries at or below it can only give -1 picks, and they are
     left out of every histogram, so rows that are mostly -inf (a cache filled to L < T) add no atomic contention).
     Work with distances d = M - key (uint32, 0 = the best): the k-th largest key is the k-th smallest d.
  1. Pass 1 bins d logarithmically: bin = 64 j + (d >> j), j = max(floor(log2 d) - 6, 0), i.e. d with 7 significant
     bits, 1728 bins, monotone in d. Scores near the top get fine bins whatever their scale (an 11-bit digit of the
     raw key would put a row's scores into the few bins of their exponents). The bin holding the k-th smallest d
     gives an interval [lo, lo + 2^w) of d, the count c of valid entries below it (all picked) and the count in it.
  2. Further passes take the next 11 bits of d - lo inside the interval (2^min(w, 11) bins), until w = 0 (one
     distance: the k-th key K*) or the interval holds exactly the k - c entries still needed (all picked).
     Normal scores need one such pass (the 64-ulp bin it leaves usually holds exactly the one entry needed).
  3. The set: every valid entry with d < lo, and the first k - c entries of the interval in index order (ties ->
     lower index; with w = 0 they are the entries equal to K*), compacted in index order by one packed running
     count per tile (two-level: along rows of 16 lanes, then over the row sums; `scan2d`). Padding past the picks.
A bin search is a cumsum over the 2048 counters and two reductions. Rows longer than `chunk` are processed in
tiles of `chunk`, every pass reloading them (from L2) and adding up the histograms; with one tile the row is
loaded once and stays in registers (`resident`).

Measured on the H200 (session 33, CUPTI; benchmarks/results/README_indexer_compressor.md): 31.8 us for 64 x 32K
(k = 512) at the defaults, against ~35 us of kernels plus gaps for the chain; in the fp8 indexer pipeline at
B = 64 x 128K 131.6 vs 135.0 us (bf16 keys 179.2 vs 181.5, fp4 142.7 vs 146.1). Where the time goes: loading the
row and its max ~4.7 us, pass 1 ~5-7, the refining pass ~7, the compaction ~13-15: like the one-program-per-row
kernel of session 24 (`topk_fused`), the index-order compaction inside one program costs the most, since block
scans are slow in Triton (`benchmarks/triton_block_ops.py`: a 1-D cumsum over 16K lanes ~3 us, the two-level one
~1.6, a 2048-bin histogram ~1.2, a reduction ~0.5). A resident 32K row (64 values a thread) spills: 36.6 us.
Reading a row takes one SM, so few or very long rows leave the GPU idle: 286 us for 1 x 262144 (the chain: 32),
1036 vs 847.5 us for the B = 64 x 1M fp8 pipeline. So it is an option, not the default: `topk_threshold` picks by
impl, and the indexer's "hist" / "hist_set" methods take this kernel for any row count.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .histogram import histogram
from .topk import INT32_MIN, NEG_INF_KEY, POS_INF_KEY, _ordered_i32

try:
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover
    plgpu = None

__all__ = ["hist_select", "tournament_select", "tournament_stage", "tournament_last_stage", "tournament_stages",
           "HIST_KERNEL_CONFIG", "TOUR_CONFIG", "pass1_bin", "bin_interval"]

BINS = 2048          # counters per histogram (11-bit digits)
MANT = 6             # pass 1: 2**MANT bins per octave of d beyond the first 128 exact ones
PACK = 4096          # _pick_bin packs (number of bins, entries) into one int32 sum: bins < PACK, entries < 2**19

# Launch settings (one program per row), swept on the H200 in session 33 (CUPTI, fp8 pipeline at B = 64 x 128K):
# chunk (the tile of a row in registers, a power of two) 16384 at 16 warps 31.8 us; 8192 33.7; 32768 (resident, 64
# values a thread) 36.6; 8 warps 38.6-42.3; 32 warps 36.9. scan2d: the compaction's two-level running count (46.1 us
# with a 1-D cumsum). refine: the passes after the first as 0 = a while loop (36.6), 1 = three passes each behind a
# cond (41.3), 2 = three passes always run, results masked (62.6). stop_after (a timing probe, wrong results): 0 =
# only the max, 1 = through pass 1, 2 = through the refining passes; the program then writes its state to slot 0.
# scan_group: lanes per row of the two-level running count (session 36, results/h200_s36r12_topk.log: 8-128 within
# the noise of each other).
HIST_KERNEL_CONFIG = dict(num_warps=16, chunk=16384, resident=True, scan2d=True, refine=0, stop_after=3, scan_group=16)


def _u32(x):
    return jax.lax.bitcast_convert_type(x, jnp.uint32)


def _i32(x):
    return jax.lax.bitcast_convert_type(x, jnp.int32)


def pass1_bin(d):
    """d uint32 [...] -> int32 bin in [0, 1728), monotone non-decreasing in d: d itself below 128, else
    64 j + (d >> j) with j = floor(log2 d) - 6 (d to 7 significant bits)."""
    e = 31 - jax.lax.clz(_i32(d))                                   # floor(log2 d); -1 for d = 0
    j = jnp.maximum(e - MANT, 0)
    return (j << MANT) + _i32(d >> _u32(j))


def bin_interval(b):
    """A pass-1 bin b (int32 scalar or array) -> (lo uint32, w int32): the bin holds exactly d in [lo, lo + 2**w)."""
    j = jnp.maximum((b >> MANT) - 1, 0)
    return _u32((b - (j << MANT)) << j), j


def _pick_bin(hist, need):
    """hist [BINS] int32 (counts over increasing d), 1 <= need -> (b, below, in_bin): the bin of the need-th smallest
    d, the count in the bins before it, the count in it. b = BINS (and in_bin meaningless) when the histogram holds
    fewer than `need` entries."""
    cum = jnp.cumsum(hist)
    under = cum < need
    packed = jnp.sum(jnp.where(under, 1 + hist * PACK, 0))         # one reduction: number of bins, entries
    b, below = packed & (PACK - 1), packed // PACK
    at = jnp.min(jnp.where(under, jnp.int32(2 ** 31 - 1), cum))
    return b, below, at - below


def _select_into(src_ref, posmap_ref, outs, r, base, end, out_row, col0, tail_base, *, k, slots, kp, chunk, n_tiles,
                 resident, finite_only, set_out, tail, stop_after, scan2d, refine, keys_in):
    """The top-k set of columns [base, end) of row r of src_ref (floats, or ordered int32 keys if keys_in) written
    into row out_row of `outs` (keys, pos; or the set alone), columns [col0, col0 + slots), ascending position,
    padding after the picks. posmap_ref (or None): the positions written are posmap[r, column] instead of the
    column. slots >= k: with slots > k the selection stops refining as soon as the entries up to the k-th's interval
    fit and writes all of those (a superset of the top-k set: a tournament's segment stage needs no exact set).
    tail (interpreter only): lanes that store nothing write to distinct columns from tail_base on instead (the
    interpreter's masked scatter would otherwise let a masked lane overwrite a picked one)."""
    lanes = jax.lax.iota(jnp.int32, chunk)

    def load(t):
        cols = base + t * chunk + lanes
        inside = cols < end
        if keys_in:
            return plgpu.load(src_ref.at[r, cols], mask=inside, other=INT32_MIN), cols
        x = plgpu.load(src_ref.at[r, cols], mask=inside, other=-jnp.inf)
        return _ordered_i32(x), cols

    first = load(0) if resident else None
    tile = (lambda t: first) if resident else load

    def over_tiles(fn, init):
        """fn(key [chunk], cols [chunk], carry) -> carry, folded over the row's tiles."""
        if n_tiles == 1:
            return fn(*tile(0), init)
        return jax.lax.fori_loop(0, n_tiles, lambda t, c: fn(*tile(t), c), init)

    # 0. the largest valid key; distances d = M - key (uint32 in the unsigned-key domain: no wrap, d >= 0)
    m = over_tiles(lambda key, cols, acc: jnp.maximum(acc, jnp.max(jnp.where(key > NEG_INF_KEY, key, INT32_MIN))),
                   jnp.int32(INT32_MIN))
    um = _u32(m ^ jnp.int32(INT32_MIN))
    dist = lambda key: um - _u32(key ^ jnp.int32(INT32_MIN))
    zeros = jnp.zeros((BINS,), jnp.int32)
    probe = lambda v: plgpu.store(outs[0].at[out_row, col0 + jax.lax.iota(jnp.int32, 2)], jnp.full((2,), v, jnp.int32))
    if stop_after == 0:
        return probe(m)

    # 1. logarithmic bins of d
    hist = over_tiles(lambda key, cols, acc: acc + histogram(pass1_bin(dist(key)), BINS, mask=key > NEG_INF_KEY),
                      zeros)
    b, below, in_bin = _pick_bin(hist, jnp.int32(k))
    take_all = b >= BINS                                            # fewer than k valid entries: all of them
    lo, w = bin_interval(jnp.minimum(b, BINS - 1))
    w = jnp.where(take_all, 0, w)
    if stop_after == 1:
        return probe(_i32(lo) + w + below + in_bin)

    # 2. 11 more bits of d - lo per pass, until one distance is left or the interval is exactly what is needed
    def cond(s):
        lo, w, c, n_in = s
        return (w > 0) & (n_in > slots - c)

    def body(s):
        lo, w, c, _ = s
        sh = jnp.maximum(w - 11, 0)

        def count(key, cols, acc):
            dd = dist(key) - lo
            inside = (key > NEG_INF_KEY) & ((dd >> _u32(w)) == 0)
            return acc + histogram(_i32(dd >> _u32(sh)), BINS, mask=inside)

        b2, below2, in2 = _pick_bin(over_tiles(count, zeros), k - c)
        return lo + _u32(b2 << sh), sh, c + below2, in2

    state = (lo, w, below, in_bin)
    if refine == 0:     # a dynamic loop
        state = jax.lax.while_loop(cond, body, state)
    else:               # at most ceil(25 / 11) = 3 passes (w <= 25 after pass 1), each skipped (1) or masked (2)
        for _ in range(3):
            if refine == 1:
                state = jax.lax.cond(cond(state), body, lambda s: s, state)
            else:
                new, go = body(state), cond(state)
                state = tuple(jnp.where(go, a, b) for a, b in zip(new, state))
    lo, w, c, _ = state
    if stop_after == 2:
        return probe(_i32(lo) + w + c)

    # 3. the set in index order: d < lo (all), then the first slots - c of the interval; one packed cumsum per tile
    need = slots - c
    sh_a = int(slots).bit_length()                                  # A's running count (< k) in the low bits
    mask_a = (1 << sh_a) - 1

    def running(x):
        """Inclusive running sum of x and its total. scan2d: two levels, [chunk / G, G]: a scan along each row's
        G lanes and one over the row sums (a 1-D block scan costs ~3 us at 16K, the two levels ~1.6: session 33,
        benchmarks/triton_block_ops.py)."""
        if x.ndim == 1:
            c = jnp.cumsum(x)
            return c, jnp.max(c)
        rows = jnp.sum(x, axis=1)
        rows_c = jnp.cumsum(rows)
        return jnp.cumsum(x, axis=1) + (rows_c - rows)[:, None], jnp.max(rows_c)

    def write(key, cols, carry):
        off_a, off_e = carry
        tail_lanes = lanes
        if scan2d:   # the whole pass on [chunk / G, G], G = scan_group lanes a row
            key, cols, tail_lanes = (v.reshape(chunk // scan2d, scan2d) for v in (key, cols, lanes))
        valid = key > NEG_INF_KEY
        if finite_only:
            valid = valid & (key < POS_INF_KEY)
        d = dist(key)
        below_lo = valid & (take_all | (d < lo))
        interval = valid & ~take_all & (((d - lo) >> _u32(w)) == 0)
        packed, total = running(below_lo.astype(jnp.int32) + (interval.astype(jnp.int32) << sh_a))
        ca = off_a + (packed & mask_a)
        ce = off_e + (packed >> sh_a)
        sel = below_lo | (interval & (ce <= need))
        at = jnp.where(sel, col0 + ca + jnp.minimum(ce, need) - 1, (tail_base + tail_lanes) if tail else 0)
        pos = plgpu.load(posmap_ref.at[r, cols], mask=sel, other=0) if posmap_ref is not None else cols
        if set_out:
            plgpu.store(outs[0].at[out_row, at], pos, mask=sel)
        else:
            plgpu.store(outs[0].at[out_row, at], key, mask=sel)
            plgpu.store(outs[1].at[out_row, at], pos, mask=sel)
        return off_a + (total & mask_a), off_e + (total >> sh_a)

    off_a, off_e = over_tiles(write, (jnp.int32(0), jnp.int32(0)))
    n_out = off_a + jnp.minimum(off_e, need)
    pad_lanes = jax.lax.iota(jnp.int32, kp)
    pad = (pad_lanes >= n_out) & (pad_lanes < slots)
    if set_out:
        plgpu.store(outs[0].at[out_row, col0 + pad_lanes], jnp.full((kp,), -1, jnp.int32), mask=pad)
    else:
        plgpu.store(outs[0].at[out_row, col0 + pad_lanes], jnp.full((kp,), INT32_MIN, jnp.int32), mask=pad)
        plgpu.store(outs[1].at[out_row, col0 + pad_lanes], jnp.zeros((kp,), jnp.int32), mask=pad)


def _hist_kernel(scores_ref, *refs, T, segments, seg_len, mapped, **opts):
    """Program p: the top-k set of segment p % segments (columns [base, base + seg_len) of row p // segments), into
    output row p (`_select_into`). mapped: the first ref after the scores is a position map [R, T] int32."""
    posmap_ref, outs = (refs[0], refs[1:]) if mapped else (None, refs)
    p = pl.program_id(0)
    r, base = (p // segments, (p % segments) * seg_len) if segments > 1 else (p, 0)
    end = jnp.minimum(base + seg_len, T) if segments > 1 else T
    _select_into(scores_ref, posmap_ref, outs, r, base, end, p, 0, opts["slots"], **opts)


def _check_select_args(name, scores, k, finite_only, set_out, posmap):
    """The arguments every selection entry point shares -> (R, T): 1 <= k <= T, set_out only with finite_only,
    float or ordered-int32 scores [R, T], posmap int32 [R, T] or None."""
    R, T = scores.shape
    if not 1 <= k <= T:
        raise ValueError(f"{name}: need 1 <= k ({k}) <= T ({T})")
    if set_out and not finite_only:
        raise ValueError(f"{name}: set_out needs finite_only (the set's -1s stand for non-finite picks)")
    if scores.dtype not in (jnp.float32, jnp.int32) and not jnp.issubdtype(scores.dtype, jnp.floating):
        raise ValueError(f"{name}: scores must be floating or int32 ordered keys, got {scores.dtype}")
    if posmap is not None and (posmap.shape != (R, T) or posmap.dtype != jnp.int32):
        raise ValueError(f"{name}: posmap must be int32 [{R}, {T}], got {posmap.dtype} {posmap.shape}")
    return R, T


def _select_opts(span, k, slots, chunk, resident, finite_only, set_out, keys_in, interpret):
    """`_select_into`'s static options for a program covering `span` columns: the tile (`chunk`, a power of two,
    at most the span's padded length; HIST_KERNEL_CONFIG's by default), the tile count, whether the one tile stays
    in registers, the padded store width kp, and the kernel constants."""
    cfg = HIST_KERNEL_CONFIG
    chunk = int(chunk or cfg["chunk"])
    if chunk & (chunk - 1):
        raise ValueError(f"hist_select: chunk must be a power of two, got {chunk}")
    chunk = min(chunk, 1 << (span - 1).bit_length())                # one tile of the span's padded length
    n_tiles = -(-span // chunk)
    resident = (cfg["resident"] if resident is None else resident) and n_tiles == 1
    if (chunk << int(slots).bit_length()) >= 2 ** 31 or span >= 2 ** 19:
        raise ValueError(f"hist_select: chunk {chunk} x k {k} or {span} columns a program too large for the "
                         f"packed counts")
    return dict(k=k, slots=slots, kp=1 << (slots - 1).bit_length(), chunk=chunk, n_tiles=n_tiles, resident=resident,
                finite_only=finite_only, set_out=set_out, tail=bool(interpret), stop_after=int(cfg["stop_after"]),
                scan2d=int(cfg["scan_group"]) if cfg["scan2d"] and chunk >= 2 * cfg["scan_group"] else 0,
                refine=int(cfg["refine"]), keys_in=keys_in)


def hist_select(scores, k: int, *, finite_only: bool = False, set_out: bool = False, chunk: int | None = None,
                num_warps: int | None = None, resident: bool | None = None, seg_len: int | None = None,
                posmap=None, slack: int = 0, interpret: bool = False):
    """scores [R, T] float32 (or int32: ordered keys as `_ordered_i32` writes them, INT32_MIN = padding) -> the
    exact top-k set of each row in ascending position (see module doc): (keys [R, k], pos [R, k]) with
    (INT32_MIN, 0) padding, or with set_out=True (requires finite_only) pos [R, k] with -1 padding, the final index
    set. One Triton program per row; 1 <= k <= T.
    seg_len: each row cut into NS = ceil(T / seg_len) segments of seg_len columns (a power of two), one program
    each: the outputs are [R * NS, k], row r * NS + j = the top-k set of segment j of row r (positions in the row).
    posmap [R, T] int32: the positions written are posmap[row, column] instead of the column (a later stage of
    `tournament_select` writes the first stage's positions).
    slack > 0: outputs of k + slack slots a row holding a superset of the top-k set (every entry up to the k-th's
    last refined interval, ties -> lower position), ascending position, padding after: one histogram pass fewer
    where the k-th's bin fits (a tournament's first stage)."""
    R, T = _check_select_args("hist_select", scores, k, finite_only, set_out, posmap)
    segments = 1
    if seg_len is not None:
        if seg_len < 1 or seg_len & (seg_len - 1):
            raise ValueError(f"hist_select: seg_len must be a power of two, got {seg_len}")
        segments = -(-T // seg_len)
    span = T if segments == 1 else seg_len                          # columns one program covers
    if slack < 0:
        raise ValueError(f"hist_select: slack must be >= 0, got {slack}")
    keys_in = scores.dtype == jnp.int32
    opts = _select_opts(span, k, k + int(slack), chunk, resident, finite_only, set_out, keys_in, interpret)
    slots = opts["slots"]
    width = slots + opts["chunk"] if interpret else slots          # interpreter: a tail for the unstored lanes
    kernel = functools.partial(_hist_kernel, T=T, segments=segments, seg_len=span, mapped=posmap is not None,
                               **opts)
    extra = {} if interpret else dict(compiler_params=plgpu.CompilerParams(
        num_warps=int(num_warps or HIST_KERNEL_CONFIG["num_warps"]), num_stages=1))
    n_out = 1 if set_out else 2
    rows = R * segments
    full = lambda shape: pl.BlockSpec(shape, lambda i: (0,) * len(shape))
    inputs = [scores if keys_in else scores.astype(jnp.float32)] + ([] if posmap is None else [posmap])
    outs = pl.pallas_call(
        kernel, grid=(rows,), in_specs=[full((R, T))] * len(inputs), out_specs=[full((rows, width))] * n_out,
        out_shape=[jax.ShapeDtypeStruct((rows, width), jnp.int32)] * n_out, interpret=interpret,
        name="topk_hist" if segments == 1 else "topk_hist_segments", **extra,
    )(*inputs)
    outs = [o[:, :slots] for o in outs] if interpret else outs
    return outs[0] if set_out else tuple(outs)


# tournament_select's launch settings (module doc; swept on the H200 in session 36: benchmarks/topk_stages.py,
# benchmarks/indexer.py --set-configs 'topk=tour_set,tour.NAME=value'). seg_chunk: a segment program's tile
# (0 = HIST_KERNEL_CONFIG's; below seg_len the tiles are reloaded every pass)
# fuse_final: the last segment stage and the final selection in one kernel (`tournament_last_stage`; session 38).
# Off: on the H200 (session 39) its GPU tests pass but it is slower: 64 x 32768 36.0 -> 47-52 us, the fp8 indexer
# at B = 64 x 128K 125.2 -> 135.0 us (not profiled; likely every segment program carrying the final's code, and
# the last rows' selections running on 8 warps after all segments). fused_chunk: the final selection's tile there
# (the survivors are reloaded from L2 every pass when they span more than one tile); fused_warps: that kernel's
# warps (0 = seg_warps)
TOUR_CONFIG = dict(seg_len=4096, final_max=8192, seg_warps=8, final_warps=16, seg_slack=64, seg_chunk=0,
                   fuse_final=False, fused_chunk=4096, fused_warps=0)


def _tour_settings(seg_len=None, final_max=None, seg_slack=None):
    """(seg_len, final_max, slack): the arguments given, else TOUR_CONFIG's; final_max at least one segment."""
    cfg = TOUR_CONFIG
    seg_len = int(seg_len or cfg["seg_len"])
    slack = int(cfg["seg_slack"] if seg_slack is None else seg_slack)
    return seg_len, max(int(final_max or cfg["final_max"]), seg_len), slack


def _stage_runs(width: int, k: int, seg_len: int, final_max: int, slack: int) -> bool:
    """Whether the tournament cuts rows of `width` candidates into segments once more before its final selection."""
    return width > final_max and seg_len >= 2 * (k + slack)


def tournament_stages(T: int, k: int) -> int:
    """How many segment stages `tournament_select` (at TOUR_CONFIG) runs on rows of T candidates before its final
    selection."""
    seg_len, final_max, slack = _tour_settings()
    n = 0
    while _stage_runs(T, k, seg_len, final_max, slack):
        T, n = -(-T // seg_len) * (k + slack), n + 1
    return n


def tournament_stage(scores, k: int, posmap=None, *, seg_len: int | None = None, seg_warps: int | None = None,
                     seg_slack: int | None = None, interpret: bool = False):
    """One segment stage of `tournament_select`: scores [R, T] (floats or ordered int32 keys), posmap [R, T] int32 or
    None -> (keys, pos) [R, NS * (k + slack)], each segment's k + slack slots (a superset of its top-k set, ascending
    position, padding (INT32_MIN, 0)) side by side; pos are positions in the original row."""
    R, _ = scores.shape
    seg_len, _, slack = _tour_settings(seg_len, None, seg_slack)
    cfg = TOUR_CONFIG
    keys, pos = hist_select(scores, k, seg_len=seg_len, posmap=posmap, num_warps=seg_warps or cfg["seg_warps"],
                            slack=slack, chunk=cfg["seg_chunk"] or None, interpret=interpret)
    return keys.reshape(R, -1), pos.reshape(R, -1)


def _tour_last_kernel(scores_ref, *refs, T, segments, seg_len, width1, mapped, seg_opts, fin_opts, interpret):
    """Program p: segment p % segments of row r = p // segments into columns [j * slots1, (j + 1) * slots1) of
    row r of the survivor arrays (keys1, pos1); then the row's program that finishes its segment last (an arrival
    counter per row) selects the exact set among the row's survivors into the final outputs."""
    refs = list(refs)
    posmap_ref = refs.pop(0) if mapped else None
    refs.pop(0)                                                     # the counters' input, aliased to count_ref
    keys1, pos1, count_ref, *fin = refs
    p = pl.program_id(0)
    r, j = p // segments, p % segments
    base = j * seg_len
    slots1 = seg_opts["slots"]
    _select_into(scores_ref, posmap_ref, (keys1, pos1), r, base, jnp.minimum(base + seg_len, T), r, j * slots1,
                 segments * slots1, **seg_opts)
    # Every thread's survivor stores are issued before one thread's acq_rel atomic (gpu scope) publishes them: the
    # barrier orders them within the CTA, the release makes them visible to the program that acquires the count
    # last (RMWs on one address form a release sequence; the acquire invalidates its SM's L1, and Triton broadcasts
    # the atomic's result through shared memory behind a barrier, so every thread's loads come after it).
    if not interpret:   # (the interpreter runs one program at a time and has no barrier)
        plgpu.debug_barrier()
    arrived = plgpu.atomic_add(count_ref, (r,), jnp.int32(1))

    @pl.when(arrived == segments - 1)
    def _():
        _select_into(keys1, pos1, fin, r, 0, width1, r, 0, fin_opts["slots"], **fin_opts)


def tournament_last_stage(scores, k: int, posmap=None, *, finite_only: bool = False, set_out: bool = False,
                          seg_len: int | None = None, seg_slack: int | None = None, chunk: int | None = None,
                          num_warps: int | None = None, interpret: bool = False):
    """A tournament's last segment stage and its final selection in one kernel: `hist_select`'s results (same
    contract: keys / pos [R, k], or the set with set_out) for scores [R, T] (floats or ordered int32 keys) whose
    segments' survivors, ceil(T / seg_len) x (k + slack) a row, are the last candidates (posmap: as in
    `tournament_stage`). One program per segment writes its k + slack survivors into a per-row array; the program of
    each row that finishes last (an atomic arrival count per row, zeroed by XLA before the call) selects the exact
    set among them, so the rows that finish early overlap their final selection with the other rows' segments, and
    one launch (and the gap after it) goes. chunk: the final selection's tile (TOUR_CONFIG["fused_chunk"]); num_warps:
    TOUR_CONFIG["fused_warps"] or the segment programs' seg_warps."""
    R, T = _check_select_args("tournament_last_stage", scores, k, finite_only, set_out, posmap)
    seg_len, _, slack = _tour_settings(seg_len, None, seg_slack)
    if seg_len & (seg_len - 1):
        raise ValueError(f"tournament_last_stage: seg_len must be a power of two, got {seg_len}")
    cfg = TOUR_CONFIG
    keys_in = scores.dtype == jnp.int32
    segments = -(-T // seg_len)
    seg_opts = _select_opts(seg_len, k, k + slack, cfg["seg_chunk"] or None, None, False, False, keys_in, interpret)
    width1 = segments * seg_opts["slots"]                           # a row's survivors
    fin_opts = _select_opts(width1, k, k, chunk or cfg["fused_chunk"], None, finite_only, set_out, True, interpret)
    tail = lambda opts: opts["chunk"] if interpret else 0          # interpreter: columns for the unstored lanes
    n_fin = 1 if set_out else 2
    kernel = functools.partial(_tour_last_kernel, T=T, segments=segments, seg_len=seg_len, width1=width1,
                               mapped=posmap is not None, seg_opts=seg_opts, fin_opts=fin_opts, interpret=interpret)
    warps = num_warps or cfg["fused_warps"] or cfg["seg_warps"]
    extra = {} if interpret else dict(compiler_params=plgpu.CompilerParams(num_warps=int(warps), num_stages=1))
    full = lambda shape: pl.BlockSpec(shape, lambda i: (0,) * len(shape))
    inputs = ([scores if keys_in else scores.astype(jnp.float32)] + ([] if posmap is None else [posmap])
              + [jnp.zeros((R,), jnp.int32)])
    shapes = ([(R, width1 + tail(seg_opts))] * 2 + [(R,)] + [(R, k + tail(fin_opts))] * n_fin)
    outs = pl.pallas_call(
        kernel, grid=(R * segments,), in_specs=[full(x.shape) for x in inputs],
        out_specs=[full(sh) for sh in shapes], out_shape=[jax.ShapeDtypeStruct(sh, jnp.int32) for sh in shapes],
        input_output_aliases={len(inputs) - 1: 2}, interpret=interpret, name="topk_tour_last", **extra,
    )(*inputs)
    fin = [o[:, :k] for o in outs[3:]]
    return fin[0] if set_out else tuple(fin)


def tournament_select(scores, k: int, *, finite_only: bool = False, set_out: bool = False,
                      seg_len: int | None = None, final_max: int | None = None, seg_warps: int | None = None,
                      final_warps: int | None = None, seg_slack: int | None = None, fuse_final: bool | None = None,
                      interpret: bool = False):
    """`hist_select`'s results (same arguments and contract) by a tournament: while a row holds more than
    `final_max` candidates, cut it into segments of `seg_len` and keep each segment's top-k set (one program per
    segment: the whole GPU works on a few rows); the last call selects among the survivors, <= final_max a row.
    Exact, ties included: an entry among the row's top k (by score, then lower position) is among its segment's
    top k, and the survivors stay in ascending position (segment by segment), so ties still go to the lower
    position. Each stage keeps k + seg_slack of every seg_len entries (seg_len >= 2k): a superset of the segment's
    top-k set, so a segment program skips its refining histogram pass where the k-th's pass-1 bin fits the slack.
    fuse_final (default TOUR_CONFIG["fuse_final"]): the last segment stage and the final selection in one kernel
    (`tournament_last_stage`)."""
    T = scores.shape[1]
    if not 1 <= k <= T:
        raise ValueError(f"tournament_select: need 1 <= k ({k}) <= T ({T})")
    seg_len, final_max, slack = _tour_settings(seg_len, final_max, seg_slack)
    fuse = TOUR_CONFIG["fuse_final"] if fuse_final is None else fuse_final
    x, posmap = scores, None
    while _stage_runs(x.shape[1], k, seg_len, final_max, slack):
        survivors = -(-x.shape[1] // seg_len) * (k + slack)
        if fuse and not _stage_runs(survivors, k, seg_len, final_max, slack):   # the last stage: with the final
            return tournament_last_stage(x, k, posmap, finite_only=finite_only, set_out=set_out, seg_len=seg_len,
                                         seg_slack=slack, num_warps=seg_warps, interpret=interpret)
        x, posmap = tournament_stage(x, k, posmap, seg_len=seg_len, seg_warps=seg_warps, seg_slack=slack,
                                     interpret=interpret)
    return hist_select(x, k, finite_only=finite_only, set_out=set_out, posmap=posmap,
                       num_warps=final_warps or TOUR_CONFIG["final_warps"], interpret=interpret)
