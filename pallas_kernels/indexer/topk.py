"""Exact top-k selections for the indexer: alternatives to one `lax.top_k` (a sort) over all T candidates.

    topk_threshold(scores [..., T] f32, k, *, impl="xla") -> picks [..., min(k, T)] int32   (the GPU default)
    topk_grouped(scores, k, *, group=32)                  -> same
    topk_radix(scores, k, *, bits_per_pass=8)             -> same

* threshold: tau = the k-th largest of ~2k..4k strided-group maxima is a provable lower bound of the k-th score;
  the entries >= tau (~1.4k for i.i.d. scores) are compacted in index order (a Triton kernel on GPU) and ordered
  by a top_k over ~4k slots (or the Triton rank-counting kernel, impl="pallas"); a row with too many survivors
  gets its exact top-k set from a radix-select kernel (GPU) or sends the call to the grouped path (lax.cond, XLA
  impl). impl="pallas_select" replaces both sorts over groups / slots with Triton radix selects in registers
  (`bound_pallas`, `select_pallas`) and sorts only the k picks (or nothing, sorted=False: an index set). See
  `topk_threshold`.
* grouped: top-k groups by their max, then top-k over those groups' entries (`_grouped_positions`).
* radix: radix select of the exact k-th key, then compaction (below).
Measured on the H200: `benchmarks/results/README_indexer_compressor.md`.

Radix select in detail. Contract (every method): bit-identical to `gpu.topk_from_scores(scores, k, topk="lax")` (the k highest scores sorted descending,
ties -> lower index, then -1 where the picked score is not finite), for every input.

`lax.top_k` orders float32 by XLA's *total order* (the comparator bitcasts to int and flips the magnitude bits of
negatives): -NaN < -inf < ... < -0.0 < +0.0 < ... < +inf < +NaN, so -0.0 and +0.0 are NOT tied (+0.0 ranks
above -0.0 even at a higher index), and NaNs have a definite rank. The key map below is that same total order
on uint32, so no special case is needed for signed zeros, and NaN inputs give the same picks as `lax.top_k` too
(their picks come out as -1, like +inf ones, since the final mask is `isfinite`). The indexer never produces
NaN / +inf; -inf marks invalid entries. (XLA's GPU top-k itself strayed from the total order for NaN at k = 16 on
the H200, session 32: the tests take the CPU's lax.top_k as the oracle.)

Algorithm (per row; every shape static, no data-dependent sizes):
  1. keys = bits ^ (0xFFFFFFFF if sign else 0x80000000)  (uint32, order-preserving: key order = total order).
  2. radix select of K* = the exact k-th largest key: P = 32 / bits_per_pass passes, most significant digit
     first. With the high bits fixed in `prefix`, one fused compare + sum over T counts, for every digit value j
     (2**bits_per_pass of them), c_j = #{keys >= prefix | j << shift}; the largest j with c_j >= k extends the
     prefix. Invariant: #{keys >= prefix} >= k (true at prefix = 0 as k <= T), and after the last pass
     prefix = max{v : #{keys >= v} >= k} = K*. The same counts give c_gt = #{keys > K*} for free (the count at
     the digit above the chosen one, carried over passes where the chosen digit is the top one).
  3. selection: every key > K* (c_gt of them, c_gt < k) plus the first r = k - c_gt keys == K* in index order
     (rank among the equal keys = cumsum of the equal-mask; #{keys >= K*} >= k guarantees r of them exist), so
     exactly k entries, the same set `lax.top_k` picks. One int32 cumsum carries both running counts packed
     (eq * M + gt with M = 2**ceil(log2 k) > c_gt) when T * M < 2**31, else two cumsums. The picked indices are
     compacted in ascending index order into [.., k] by a scatter at position (running count of selected) - 1.
  4. order: `lax.top_k` over the k gathered scores (same total-order comparator; ties -> lower position = lower
     index, since the compacted list is index-ascending), gather the indices, -1 where the score is not finite.

Cost per row: P * T * 2**bits compares (+ reduce) for step 2, then O(T) for step 3 (one or two cumsums and a
scatter) and a top_k over k for step 4. bits_per_pass=8: 4 passes x 256 thresholds = 1024 compares per score;
bits_per_pass=4: 8 passes x 16 = 128 per score (8x less work) but twice the sequential passes (each pass is a
reduction kernel plus a tiny digit pick). When the passes are latency-bound (small B * T) fewer passes can win;
once B * T is large the compare work dominates and 4 bits wins (at T = 262144, 8 bits is ~268M compares per row).
The compare must stay fused into the reduction (no [R, T, 2**bits] buffer): expected of XLA GPU's reduction
fusion (not verified on a GPU here); XLA CPU materializes it, one reason this is far slower than `lax.top_k` on
CPU. bits_per_pass must divide 32 (1, 2, 4, 8, 16).
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

try:
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover
    plgpu = None

__all__ = ["float_keys", "kth_largest_key", "topk_radix", "topk_grouped", "topk_threshold"]

PACK_LIMIT = 2 ** 31  # one packed int32 cumsum while (T + 1) * M stays below this (a module constant for tests)


def _as_rows(scores, k: int):
    """scores [..., T] -> (float32 rows [R, T], the leading dims, min(k, T)); every method's preamble."""
    scores = jnp.asarray(scores)
    T = scores.shape[-1]
    return scores.astype(jnp.float32).reshape((-1, T)), scores.shape[:-1], max(0, min(int(k), T))


def _finite_picks(s, idx, lead):
    """Positions [R, k] (-1 allowed) of rows s -> picks [*lead, k] int32: -1 where the picked score is not finite."""
    vals = jnp.take_along_axis(s, jnp.maximum(idx, 0), axis=1)
    return jnp.where((idx >= 0) & jnp.isfinite(vals), idx, -1).astype(jnp.int32).reshape(lead + (idx.shape[1],))


def float_keys(scores):
    """float32 [...] -> uint32 keys whose unsigned order is XLA's float total order (the order `lax.top_k` uses)."""
    bits = jax.lax.bitcast_convert_type(scores.astype(jnp.float32), jnp.uint32)
    neg = (bits >> 31) != 0
    return bits ^ jnp.where(neg, jnp.uint32(0xFFFFFFFF), jnp.uint32(0x80000000))


def kth_largest_key(keys, k: int, bits_per_pass: int = 8):
    """keys [R, T] uint32, 1 <= k <= T -> (K* [R] uint32, the exact k-th largest key of each row, and
    c_gt [R] int32 = #{keys > K*}), by radix select."""
    if 32 % bits_per_pass:
        raise ValueError(f"bits_per_pass must divide 32, got {bits_per_pass}")
    R = keys.shape[0]
    n_digits = 1 << bits_per_pass
    digits = jnp.arange(n_digits, dtype=jnp.uint32)
    prefix = jnp.zeros((R,), jnp.uint32)
    above = jnp.zeros((R,), jnp.int32)   # #{keys above the current range [prefix, prefix + 2**(shift + bits))}
    for p in range(32 // bits_per_pass):
        shift = 32 - (p + 1) * bits_per_pass
        thr = prefix[:, None] | (digits << shift)[None, :]                               # [R, 2**bits]
        cnt = jnp.sum(keys[:, :, None] >= thr[:, None, :], axis=1, dtype=jnp.int32)     # [R, 2**bits]
        # counts are non-increasing in j and cnt[:, 0] = #{keys >= prefix} >= k: the largest j with cnt >= k
        j = jnp.sum(cnt >= k, axis=1, dtype=jnp.int32) - 1
        nxt = jnp.take_along_axis(cnt, jnp.minimum(j + 1, n_digits - 1)[:, None], axis=1)[:, 0]
        above = jnp.where(j + 1 < n_digits, nxt, above)                                  # = #{keys >= new range end}
        prefix = prefix | (j.astype(jnp.uint32) << shift)
    return prefix, above


def _compact_selected(keys, kstar, c_gt, k: int):
    """Indices [R, k] int32 (ascending) of the keys > kstar (c_gt [R] of them) plus the first k - c_gt keys == kstar."""
    R, T = keys.shape
    gt = keys > kstar[:, None]
    eq = keys == kstar[:, None]
    r = k - c_gt                                                                         # [R], >= 1
    M = 1 << max(k - 1, 0).bit_length()                                                  # power of two >= k > c_gt
    if (T + 1) * M < PACK_LIMIT:  # one cumsum: running #eq in the high part, running #gt (< M) in the low part
        c = jnp.cumsum(eq.astype(jnp.int32) * M + gt.astype(jnp.int32), axis=1)
        run_eq, run_gt = c // M, c & (M - 1)
    else:
        run_eq = jnp.cumsum(eq.astype(jnp.int32), axis=1)
        run_gt = jnp.cumsum(gt.astype(jnp.int32), axis=1)
    sel = gt | (eq & (run_eq <= r[:, None]))
    pos = jnp.where(sel, run_gt + jnp.minimum(run_eq, r[:, None]) - 1, k)               # k = dropped
    rows = jax.lax.broadcasted_iota(jnp.int32, (R, T), 0)
    idx = jax.lax.broadcasted_iota(jnp.int32, (R, T), 1)
    return jnp.zeros((R, k), jnp.int32).at[rows, pos].set(idx, mode="drop")


def topk_radix(scores, k: int, *, bits_per_pass: int = 8):
    """scores [..., T] float32 (-inf = invalid) -> picks [..., min(k, T)] int32, bit-identical to
    `topk_from_scores(scores, min(k, T), topk="lax")`: sorted by descending score, ties -> lower index, -1 where the
    picked score is not finite."""
    if 32 % bits_per_pass:
        raise ValueError(f"bits_per_pass must divide 32, got {bits_per_pass}")
    s, lead, k = _as_rows(scores, k)
    if k == 0:
        return jnp.zeros(lead + (0,), jnp.int32)
    keys = float_keys(s)
    kstar, c_gt = kth_largest_key(keys, k, bits_per_pass)
    cand = _compact_selected(keys, kstar, c_gt, k)                                       # [R, k] ascending
    order = jax.lax.top_k(jnp.take_along_axis(s, cand, axis=1), k)[1]
    return _finite_picks(s, jnp.take_along_axis(cand, order, axis=1), lead)


# ---- grouped (two-stage) top-k -------------------------------------------------------------------------------------


def _ordered_i32(scores):
    """float32 -> int32 whose signed order is XLA's float total order (= `float_keys` ^ 2**31): negatives get their
    31 magnitude bits flipped. `lax.top_k` on it ranks exactly like `lax.top_k` on the floats, ties included."""
    bits = jax.lax.bitcast_convert_type(scores.astype(jnp.float32), jnp.int32)
    return bits ^ ((bits >> 31) & jnp.int32(0x7FFFFFFF))


def _grouped_positions(keys, k: int, group: int, direct_max: int):
    """keys [R, T] int32, 1 <= k <= T -> positions [R, k] of the k largest (ties -> lower position), in order.

    Stage 1: the max of every `group` consecutive keys; stage 2: the k best groups by that max (recursively, same
    method); stage 3: lax.top_k over those k * group candidates, gathered in ascending position order.
    Exact: order elements by (key desc, position asc). If x is among the k best and its group g was not picked,
    each of the k picked groups h has max(h) > max(g) >= key(x), or max(h) == max(g) with h < g (top-k ties go to
    the lower group), and then h's best element has a lower position than x; either way k elements beat x, a
    contradiction. So the k best all lie in the picked groups, and stage 3 ranks them exactly like a full top_k
    (candidates keep ascending positions, so ties still go to the lower position)."""
    R, T = keys.shape
    if group < 2 or T <= direct_max or T <= k * group:
        return jax.lax.top_k(keys, k)[1]
    G = -(-T // group)
    if G * group != T:  # pad with the minimum key: never picked ahead of a real entry (ties -> lower position)
        keys = jnp.pad(keys, ((0, 0), (0, G * group - T)), constant_values=jnp.iinfo(jnp.int32).min)
    grouped = keys.reshape(R, G, group)
    kg = min(k, G)
    gid = jnp.sort(_grouped_positions(jnp.max(grouped, axis=2), kg, group, direct_max), axis=1)     # [R, kg]
    cand = jnp.take_along_axis(grouped, gid[:, :, None], axis=1).reshape(R, kg * group)
    cand_pos = (gid[:, :, None] * group + jnp.arange(group, dtype=jnp.int32)).reshape(R, kg * group)
    return jnp.take_along_axis(cand_pos, jax.lax.top_k(cand, k)[1], axis=1)


def topk_grouped(scores, k: int, *, group: int = 32, direct_max: int = 8192):
    """scores [..., T] float32 (-inf = invalid) -> picks [..., min(k, T)] int32, bit-identical to
    `topk_from_scores(scores, min(k, T), topk="lax")`, by a two-stage selection (see `_grouped_positions`): the sorts
    run over T / group group maxima and k * group candidates instead of T scores. Rows of <= `direct_max` scores
    go straight to lax.top_k."""
    s, lead, k = _as_rows(scores, k)
    if k == 0:
        return jnp.zeros(lead + (0,), jnp.int32)
    return _finite_picks(s, _grouped_positions(_ordered_i32(s), k, int(group), int(direct_max)), lead)


# ---- threshold top-k: a provable lower bound of the k-th score, compaction, a top-k over the few survivors -----------

NEG_INF_KEY = -2139095041        # _ordered_i32(-inf): entries at or below it can only produce -1 picks
POS_INF_KEY = 2139095040         # _ordered_i32(+inf); NaN keys lie above it
INT32_MIN = -(2 ** 31)


def threshold_layout(T: int, k: int, capacity: Optional[int] = None):
    """(group, capacity) of `topk_threshold` for rows of T candidates: groups of a power-of-two size giving ~2k..4k
    strided groups, and `capacity` slots (default 4k, at least 256) rounded up to whole 128-slot rank_select blocks."""
    capacity = -(-int(capacity or max(4 * k, 256)) // 128) * 128
    return 1 << max(0, (T // (2 * k)).bit_length() - 1), capacity


def _survives(key, tau):
    """The compaction's keep rule: at or above the bound and above -inf's key (those can only give -1 picks)."""
    return (key >= tau) & (key > NEG_INF_KEY)


def _strided_group_max(keys, group: int):
    """keys [R, T] int32 -> [R, G] with G = ceil(T / group): the max of each strided group {j, j + G, j + 2G, ...}.
    Strided, not contiguous: when only a prefix of L entries is above -inf (a decode cache filled to L, causal
    prefill), min(L, G) groups still hold a real entry, so the bound stays tight (contiguous groups would leave
    L / group real groups, often fewer than k: bound -inf, overflow, the slow path)."""
    R, T = keys.shape
    G = -(-T // group)
    if G * group != T:
        keys = jnp.pad(keys, ((0, 0), (0, G * group - T)), constant_values=INT32_MIN)
    return jnp.max(keys.reshape(R, group, G), axis=1)


def _threshold(keys, k: int, group: int, gmax=None):
    """keys [R, T] int32 -> tau [R]: the k-th largest of the maxima of G = T / group disjoint groups of keys. The k
    groups whose max is >= tau hold k distinct entries >= tau, so the k-th largest key is >= tau: every top-k entry
    is >= tau (any partition works; `_strided_group_max` picks one that suits prefix-valid rows). gmax: the group
    maxima [R, G] when already known."""
    return jax.lax.top_k(_strided_group_max(keys, group) if gmax is None else gmax, k)[0][:, k - 1]


def producer_groups(T: int, Tp: int, k: int, *, block: int, n_split: int, pad_to_block: bool,
                    queries: int = 1) -> int:
    """G, the strided groups a scores kernel writes partial maxima of for `topk_threshold(group_max=...)`, or 0 where
    that does not pay or fit: rows returned at T (not padded to the kernel's Tp = blocks x block), no groups (the
    small-row shortcut), G not a multiple of the block, the n_split partials not under half the row, or more than
    4096 running maxima per program (`queries` rows of G each)."""
    if (Tp if pad_to_block else T) != Tp:
        return 0
    G = threshold_groups(Tp, min(int(k), Tp))
    return G if G and G % block == 0 and n_split * G <= Tp // 2 and queries * G <= 4096 else 0


def threshold_groups(T: int, k: int) -> int:
    """G, the number of strided groups `topk_threshold` bounds rows of T candidates with (0: it takes its
    small-row shortcut there, a plain lax.top_k, and needs no group maxima)."""
    group, capacity = threshold_layout(T, k)
    return 0 if T <= capacity or group < 4 else -(-T // group)


def compact_reference(keys, tau, capacity: int):
    """keys [R, T] int32, tau [R] -> (cand_keys [R, C], cand_pos [R, C], n [R]): the entries with key >= tau and key
    above -inf's, in ascending position (the first C of them; n counts all), the rest padded (INT32_MIN, 0)."""
    R, T = keys.shape
    m = _survives(keys, tau[:, None])
    c = jnp.cumsum(m.astype(jnp.int32), axis=1)
    at = jnp.where(m, c - 1, capacity)                                              # capacity = dropped
    rows = jax.lax.broadcasted_iota(jnp.int32, (R, T), 0)
    pos = jax.lax.broadcasted_iota(jnp.int32, (R, T), 1)
    cand_keys = jnp.full((R, capacity), INT32_MIN, jnp.int32).at[rows, at].set(keys, mode="drop")
    cand_pos = jnp.zeros((R, capacity), jnp.int32).at[rows, at].set(pos, mode="drop")
    return cand_keys, cand_pos, c[:, -1]


def _compact_kernel(tau_ref, counts_ref, scores_ref, keys_out, pos_out, *, T, chunk, sub, n_chunks, nc_pad,
                    capacity):
    """One program = (row r, chunk c of `chunk` scores): its survivors go to positions offset + running count, where
    offset = survivors of the row's earlier chunks (counted by XLA beforehand)."""
    r, c = pl.program_id(0), pl.program_id(1)
    tau = tau_ref[r]
    ci = jax.lax.iota(jnp.int32, nc_pad)
    before = plgpu.load(counts_ref.at[r, ci], mask=ci < jnp.minimum(c, n_chunks), other=0)
    offset = jnp.sum(before)

    lanes = jax.lax.iota(jnp.int32, sub)
    body = lambda j, off: _compact_step(scores_ref, keys_out, pos_out, r, c * chunk + j * sub, lanes, off, tau,
                                        T=T, capacity=capacity)
    jax.lax.fori_loop(0, chunk // sub, body, offset)


def _compact_step(scores_ref, keys_out, pos_out, r, start, lanes, off, tau, *, T, capacity, base=0, tail=None):
    """Row r's scores [start, start + len(lanes)): their survivors (`_survives` of tau) go to slots base + off +
    running count (those below the capacity, counted from base); returns off + their number. The lanes not stored
    write nowhere real: a lane-wide tail from `tail` (default: right past the capacity)."""
    cols = start + lanes
    inside = cols < T
    key = _ordered_i32(plgpu.load(scores_ref.at[r, cols], mask=inside, other=-jnp.inf))
    m = inside & _survives(key, tau)
    mi = m.astype(jnp.int32)
    at = off + jnp.cumsum(mi) - 1
    ok = m & (at < capacity)
    # lanes not stored get distinct slots in a lane-wide tail: the interpreter implements a masked scatter as
    # read-select-write, where a repeated index could overwrite a stored survivor
    at = jnp.where(ok, base + at, (capacity if tail is None else tail) + lanes)
    plgpu.store(keys_out.at[r, at], key, mask=ok)
    plgpu.store(pos_out.at[r, at], cols, mask=ok)
    return off + jnp.sum(mi)


def _compact_raw(scores, keys, tau, capacity: int, chunk: int, sub: int, interpret: bool):
    """compact_pallas before its epilogue: (cand_keys [R, capacity + sub], cand_pos [same], n [R]); slots >= min(n,
    capacity) hold garbage (the `sub` tail takes the lanes a program does not store)."""
    R, T = scores.shape
    sub = min(sub, chunk)
    if chunk % sub or sub & (sub - 1):
        raise ValueError(f"compact_pallas: sub ({sub}) must be a power of two dividing chunk ({chunk})")
    n_chunks = -(-T // chunk)
    pad = n_chunks * chunk - T
    m = _survives(keys, tau[:, None])
    if pad:
        m = jnp.pad(m, ((0, 0), (0, pad)))
    counts = jnp.sum(m.reshape(R, n_chunks, chunk), axis=2, dtype=jnp.int32)              # [R, n_chunks]
    nc_pad = max(2, 1 << (n_chunks - 1).bit_length())
    counts_p = jnp.pad(counts, ((0, 0), (0, nc_pad - n_chunks)))
    full = lambda shape: pl.BlockSpec(shape, lambda i, j: (0,) * len(shape))
    kernel = functools.partial(_compact_kernel, T=T, chunk=chunk, sub=sub, n_chunks=n_chunks,
                               nc_pad=nc_pad, capacity=capacity)
    extra = {} if interpret else dict(compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1))
    width = capacity + sub                                                          # + the tail of unstored lanes
    cand_keys, cand_pos = pl.pallas_call(
        kernel, grid=(R, n_chunks),
        in_specs=[full((R,)), full((R, nc_pad)), full((R, T))],
        out_specs=[full((R, width)), full((R, width))],
        out_shape=[jax.ShapeDtypeStruct((R, width), jnp.int32)] * 2, interpret=interpret,
        name="topk_compact", **extra,
    )(tau, counts_p, scores)
    return cand_keys, cand_pos, jnp.sum(counts, axis=1)


def _finish_slots(cand_keys, cand_pos, n, capacity: int):
    """Raw slot buffers -> the first `capacity` slots, slots >= n padded (INT32_MIN, 0)."""
    R = n.shape[0]
    cand_keys, cand_pos = cand_keys[:, :capacity], cand_pos[:, :capacity]
    filled = jax.lax.broadcasted_iota(jnp.int32, (R, capacity), 1) < n[:, None]      # the kernels write < n only
    return jnp.where(filled, cand_keys, INT32_MIN), jnp.where(filled, cand_pos, 0)


def compact_pallas(scores, keys, tau, capacity: int, *, chunk: int = 2048, sub: int = 1024, interpret=False):
    """`compact_reference` as a Pallas (Triton) kernel: no cumsum over T in XLA (which lowers to log2(T) scan
    levels); the per-chunk survivor counts are one XLA reduction, the prefix over chunks is done in the kernel."""
    cand_keys, cand_pos, n = _compact_raw(scores, keys, tau, capacity, chunk, sub, interpret)
    return (*_finish_slots(cand_keys, cand_pos, n, capacity), n)


COUNT_WIDTH = 1024  # lanes of the fix-up kernel's counting passes ([1024, 16] int32 counters: 64 registers a thread
                    # at 8 warps)


def _exact_rows_kernel(n_ref, tau_ref, scores_ref, keys_in, pos_in, keys_out, pos_out, *, T, k, capacity, chunk, bits):
    """One program per row; only rows whose survivors overflowed the slots (n > capacity) do anything: they get the
    exact top-k set in slots [0, k) (ascending position) and padding in [k, capacity), so the ordering stage that
    follows is exact for them too (`_fill_exact_row`)."""
    del keys_in, pos_in  # aliased to the outputs: rows without overflow keep the compaction's slots
    r = pl.program_id(0)

    @pl.when(n_ref[r] > capacity)
    def _():
        _fill_exact_row(r, tau_ref[r], scores_ref, keys_out, pos_out, T=T, k=k, capacity=capacity, chunk=chunk,
                        bits=bits)


def _fill_exact_row(r, tau, scores_ref, keys_out, pos_out, *, T, k, capacity, chunk, bits):
    """Row r of scores_ref [R, T], known to have more than `capacity` survivors of the bound tau: writes its exact
    top-k set to slots [0, k) of keys_out / pos_out (ascending position) and padding (INT32_MIN, 0) to [k,
    capacity); the slot buffers need a `chunk`-wide tail past the capacity (for lanes not stored). The exact k-th
    largest key K*: tau itself when fewer than k keys lie above it (one counting pass: the common overflow, a
    plateau of ties at the bound), else a radix select (32 / bits passes over the row, counting #{key >= prefix |
    digit} for every digit at once); then one pass that keeps every key > K* and the first k - #{key > K*} keys ==
    K* in index order (ties -> lower index, as lax.top_k). Unsigned key order u = signed ordered key ^ INT32_MIN;
    thresholds are compared in the signed domain."""
    n_chunks = -(-T // chunk)
    lanes = jax.lax.iota(jnp.int32, chunk)
    cw = min(COUNT_WIDTH, chunk)          # counting passes: per-lane counters, reduced once a pass
    n_cchunks = -(-T // cw)

    def load_keys(c, width=chunk):
        cols = c * width + jax.lax.iota(jnp.int32, width)
        inside = cols < T
        return cols, inside, _ordered_i32(plgpu.load(scores_ref.at[r, cols], mask=inside, other=-jnp.inf))

    def count_gt(v):
        def body(c, acc):
            _, inside, key = load_keys(c, cw)
            return acc + (inside & (key > v)).astype(jnp.int32)
        return jnp.sum(jax.lax.fori_loop(0, n_cchunks, body, jnp.zeros((cw,), jnp.int32)))

    def radix_kstar():
        digits = jax.lax.iota(jnp.int32, 1 << bits)
        prefix = jnp.int32(0)                                   # unsigned-order bits of the key prefix fixed so far
        for p in range(32 // bits):
            shift = 32 - (p + 1) * bits
            thr = (prefix | (digits << shift)) ^ jnp.int32(INT32_MIN)          # [2**bits], signed domain

            def count(c, acc, thr=thr):
                _, inside, key = load_keys(c, cw)
                return acc + ((key[:, None] >= thr[None, :]) & inside[:, None]).astype(jnp.int32)

            acc = jax.lax.fori_loop(0, n_cchunks, count, jnp.zeros((cw, 1 << bits), jnp.int32))
            cnt = jnp.sum(acc, axis=0)
            # cnt is non-increasing in the digit and cnt[0] = #{key >= prefix} >= k: take the largest digit with >= k
            prefix = prefix | ((jnp.sum((cnt >= k).astype(jnp.int32)) - 1) << shift)
        kstar = prefix ^ jnp.int32(INT32_MIN)
        return kstar, count_gt(kstar)

    # #{key >= tau} = n > capacity >= k; if fewer than k keys lie above tau, the k-th largest IS tau (the usual
    # overflow: a plateau of ties at the bound, e.g. many exact-zero scores): no radix passes needed
    above_tau = count_gt(tau)
    kstar, c_gt = jax.lax.cond(above_tau < k, lambda: (tau, above_tau), radix_kstar)
    r_eq = k - c_gt                                       # keys == K* to take, >= 1

    def select(c, carry):
        n_sel, n_eq = carry
        cols, inside, key = load_keys(c)
        gt = inside & (key > kstar)
        eq = inside & (key == kstar)
        eq_run = n_eq + jnp.cumsum(eq.astype(jnp.int32))
        sel = gt | (eq & (eq_run <= r_eq))
        at = n_sel + jnp.cumsum(sel.astype(jnp.int32)) - 1
        at = jnp.where(sel, at, capacity + lanes)       # unstored lanes: distinct tail slots (interpreter)
        plgpu.store(keys_out.at[r, at], key, mask=sel)
        plgpu.store(pos_out.at[r, at], cols, mask=sel)
        return n_sel + jnp.sum(sel.astype(jnp.int32)), n_eq + jnp.sum(eq.astype(jnp.int32))

    jax.lax.fori_loop(0, n_chunks, select, (jnp.int32(0), jnp.int32(0)))

    def pad(b, carry):
        cols = k + b * chunk + lanes
        keep = cols < capacity
        plgpu.store(keys_out.at[r, cols], jnp.full((chunk,), INT32_MIN, jnp.int32), mask=keep)
        plgpu.store(pos_out.at[r, cols], jnp.zeros((chunk,), jnp.int32), mask=keep)
        return carry

    jax.lax.fori_loop(0, -(-(capacity - k) // chunk), pad, 0)


def exact_rows(scores, n, tau, cand_keys, cand_pos, k: int, capacity: int, *, chunk: int = 1024, bits: int = 4,
               interpret: bool = False):
    """The overflow fix-up, in place on the raw slot buffers of `_compact_raw` ([R, capacity + chunk], chunk <=
    the compaction's tail): rows with n > capacity get the exact top-k set in slots [0, k). One launch that returns
    at once for every other row, instead of a lax.cond (on the GPU a conditional copies its predicate to the host
    and waits for it: 22 us of a 65 us selection at batch 1, measured on the H200)."""
    R, T = scores.shape
    if cand_keys.shape[1] < capacity + chunk or k > capacity or 32 % bits:
        raise ValueError(f"exact_rows: slots {cand_keys.shape} too narrow for capacity {capacity} + chunk {chunk}, "
                         f"or k {k} > capacity, or bits {bits} not dividing 32")
    full = lambda shape: pl.BlockSpec(shape, lambda i: (0,) * len(shape))
    extra = {} if interpret else dict(compiler_params=plgpu.CompilerParams(num_warps=8, num_stages=3))
    w = cand_keys.shape[1]
    return pl.pallas_call(
        functools.partial(_exact_rows_kernel, T=T, k=k, capacity=capacity, chunk=chunk, bits=bits), grid=(R,),
        in_specs=[full((R,)), full((R,)), full((R, T)), full((R, w)), full((R, w))],
        out_specs=[full((R, w)), full((R, w))],
        out_shape=[jax.ShapeDtypeStruct((R, w), jnp.int32)] * 2, input_output_aliases={3: 0, 4: 1},
        interpret=interpret, name="topk_exact_rows", **extra,
    )(n.astype(jnp.int32), tau.astype(jnp.int32), scores, cand_keys, cand_pos)


def _rank_kernel(n_ref, keys_ref, vals_ref, out_ref, *, C, k, block):
    """One program = (row r, block of `block` slots i): rank_i = #{valid j : key_j > key_i or (key_j == key_i and
    j < i)} (the position of slot i in descending key order, ties -> lower slot), counted over the row's n valid
    slots only; slots i >= n (padding, below every valid key) rank i. out[r, rank_i] = val_i where rank_i < k."""
    r, bi = pl.program_id(0), pl.program_id(1)
    n = n_ref[r]
    ii = bi * block + jax.lax.iota(jnp.int32, block)
    ki = plgpu.load(keys_ref.at[r, ii])

    def body(jb, cnt):
        jj = jb * block + jax.lax.iota(jnp.int32, block)
        kj = plgpu.load(keys_ref.at[r, jj], mask=jj < n, other=INT32_MIN)
        before = (kj[None, :] > ki[:, None]) | ((kj[None, :] == ki[:, None]) & (jj[None, :] < ii[:, None]))
        before = before & (jj < n)[None, :]
        return cnt + jnp.sum(before.astype(jnp.int32), axis=1)

    cnt = jax.lax.fori_loop(0, (n + block - 1) // block, body, jnp.zeros((block,), jnp.int32))
    rank = jnp.where(ii < n, cnt, ii)
    ok = rank < k
    at = jnp.where(ok, rank, k + jax.lax.iota(jnp.int32, block))      # distinct tail slots for unstored lanes
    plgpu.store(out_ref.at[r, at], plgpu.load(vals_ref.at[r, ii]), mask=ok)


def rank_select(keys, vals, n, k: int, *, block: int = 128, interpret: bool = False):
    """keys [R, C] int32 (valid slots [0, n) first, padding after, below every valid key), vals [R, C] int32,
    n [R] -> [R, k] vals of the k largest keys in descending order (ties -> lower slot), like
    take(vals, lax.top_k(keys, k)[1]), as one Triton kernel of O(n * C) compares: no sort."""
    R, C = keys.shape
    if C % block or k > C:
        raise ValueError(f"rank_select: C ({C}) must be a multiple of block ({block}) and >= k ({k})")
    full = lambda shape: pl.BlockSpec(shape, lambda i, j: (0,) * len(shape))
    extra = {} if interpret else dict(compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1))
    out = pl.pallas_call(
        functools.partial(_rank_kernel, C=C, k=k, block=block), grid=(R, C // block),
        in_specs=[full((R,)), full((R, C)), full((R, C))], out_specs=full((R, k + block)),
        out_shape=jax.ShapeDtypeStruct((R, k + block), jnp.int32), interpret=interpret, name="topk_rank",
        **extra,
    )(n.astype(jnp.int32), keys, vals)
    return out[:, :k]


def _radix_select_regs(key, valid, kk, bits: int, matrix: bool = False, early_exit: bool = False):
    """In-kernel radix select over an in-register vector: key [N] int32 (signed ordered keys), valid [N] bool,
    1 <= kk <= #valid (traced) -> (K*, #{valid key > K*}) with K* the kk-th largest valid key. Unsigned order
    u = key ^ INT32_MIN, fixed from the top `bits` bits down: the digit taken is the number of digits d >= 1 with
    #{valid key >= prefix | d} >= kk, since those counts are non-increasing in d and the count at d = 0 is >= kk by
    the invariant. Per pass either one reduction per nonzero digit (independent, so they overlap), or, matrix=True,
    all 2**bits counts as one reduction of an [N, 2**bits] compare matrix over N (one block-wide reduction a pass,
    N * 2**bits values in registers).
    early_exit: a dynamic loop that starts below the top bits all valid keys share (max ^ min: one pair of
    reductions) and stops as soon as exactly kk keys lie at or above the prefix (then K* is their minimum, one more
    reduction): the k-th and (k+1)-th keys part after ~log_{2**bits}(N) digits below the common ones, not 32 / bits."""
    P = 32 // bits
    digits = jax.lax.iota(jnp.int32, 1 << bits)
    imin, imax = jnp.int32(INT32_MIN), jnp.int32(2 ** 31 - 1)

    def counts(prefix, shift):
        """[#{valid key >= prefix | d << shift} for d in 1 .. 2**bits - 1] (a list of scalars)."""
        if matrix:
            thr = (prefix | (digits << shift)) ^ imin                                 # [2**bits], signed domain
            cnt = jnp.sum((valid[:, None] & (key[:, None] >= thr[None, :])).astype(jnp.int32), axis=0)
            return [jnp.sum(jnp.where(digits == d, cnt, 0)) for d in range(1, 1 << bits)]
        return [jnp.sum((valid & (key >= ((prefix | (jnp.int32(d) << shift)) ^ imin))).astype(jnp.int32))
                for d in range(1, 1 << bits)]

    if not early_exit:
        prefix = jnp.int32(0)
        for p in range(P):
            shift = 32 - (p + 1) * bits
            digit = sum((c >= kk).astype(jnp.int32) for c in counts(prefix, jnp.int32(shift)))
            prefix = prefix | (digit << shift)
        kstar = prefix ^ imin
        return kstar, jnp.sum((valid & (key > kstar)).astype(jnp.int32))

    hi = jnp.max(jnp.where(valid, key, imin))
    lo = jnp.min(jnp.where(valid, key, imax))
    common = jax.lax.clz(hi ^ lo)                                  # top bits every valid key shares (32: all equal)
    p0 = jnp.minimum(common // bits, P)
    keep = 32 - p0 * bits                                          # low bits still open, 0..32
    top = jnp.where(keep >= 32, 0, jnp.where(keep <= 0, -1, jnp.int32(-1) << jnp.clip(keep, 0, 31)))
    prefix0 = (hi ^ imin) & top
    n_valid = jnp.sum(valid.astype(jnp.int32))                    # #{valid key >= prefix0}: all of them

    def cond(c):
        p, _, n_ge = c
        return (p < P) & (n_ge != kk)

    def body(c):
        p, prefix, n_ge = c
        shift = 32 - (p + 1) * bits
        cs = counts(prefix, shift)
        digit = sum((x >= kk).astype(jnp.int32) for x in cs)
        n_new = n_ge
        for d, x in enumerate(cs, start=1):                        # #{key >= the new prefix}
            n_new = jnp.where(digit == d, x, n_new)
        return p + 1, prefix | (digit << shift), n_new

    _, prefix, n_ge = jax.lax.while_loop(cond, body, (p0, prefix0, n_valid))
    thr = prefix ^ imin
    # exactly kk keys >= thr: K* is their minimum; else every bit is fixed and thr itself is K*
    kstar = jnp.where(n_ge == kk, jnp.min(jnp.where(valid & (key >= thr), key, imax)), thr)
    return kstar, jnp.sum((valid & (key > kstar)).astype(jnp.int32))


def _take_set(gt, eq, r_eq):
    """The k-set's lanes: every key > K* (gt) and the first r_eq keys == K* (eq) in lane order. The running count of
    eq (a block-wide scan) only when the keys equal to K* outnumber r_eq: with distinct keys near the k-th they
    never do, and the scan is the costliest step of a selection (session 24)."""
    n_eq = jnp.sum(eq.astype(jnp.int32))
    return jax.lax.cond(n_eq <= r_eq, lambda: gt | eq,
                        lambda: gt | (eq & (jnp.cumsum(eq.astype(jnp.int32)) <= r_eq)))


def _row_bound(gmax_ref, r, *, P, G, Gp, k, bits, matrix, early_exit):
    """In a Triton program: tau of row r = the k-th largest of its G group maxima (the max over its P partial maxima
    [R, P, G] first), by radix select in registers (no sort)."""
    lanes = jax.lax.iota(jnp.int32, Gp)
    real = lanes < G
    load = lambda p: plgpu.load(gmax_ref.at[r, jnp.full_like(lanes, p), lanes], mask=real, other=INT32_MIN)
    gmax = jax.lax.fori_loop(1, P, lambda p, m: jnp.maximum(m, load(p)), load(0)) if P > 1 else load(0)
    return _radix_select_regs(gmax, real, k, bits, matrix, early_exit)[0]


def _bound_kernel(gmax_ref, tau_ref, **kw):
    """One program per row: tau (`_row_bound`)."""
    tau_ref[...] = jnp.full((1,), _row_bound(gmax_ref, pl.program_id(0), **kw), jnp.int32)


# Triton launch settings of the two radix-select kernels (one program per row). Swept on the H200 in session 7
# (benchmarks/topk_stages.py --select-configs): 1 / 2 / 4 warps are 1.2-5x slower, 16 warps and 1 or 4 bits per
# pass no faster; the reductions' throughput, not their latency, sets the time. *_matrix: all digit counts of a pass
# as one [N, 2**bits] reduction; early_exit: a dynamic pass loop from below the keys' common top bits to the first
# exact count (`_radix_select_regs`; both session 24).
SELECT_KERNEL_CONFIG = dict(bound_warps=8, bound_bits=2, select_warps=8, select_bits=2, bound_matrix=False,
                            select_matrix=False, early_exit=False)


def bound_pallas(gmax, k: int, *, bits: int | None = None, num_warps: int | None = None, interpret: bool = False):
    """gmax [R, G] int32 (group maxima of ordered keys, `_strided_group_max`), or [R, P, G] partial maxima (the
    group maxima are their max over P: e.g. the indexer scores kernel's per-program maxima) -> tau [R] int32 ==
    the k-th largest group maximum (`_threshold`'s `lax.top_k`, a sort over G per row), as one Triton kernel (one
    program per row). Without partials the maxima are one XLA reduction: it spreads the pass over the row across the
    whole GPU, which one program per row would not (at batch 1 it would read 1 MB alone)."""
    if gmax.ndim == 2:
        gmax = gmax[:, None, :]
    R, P, G = gmax.shape
    bits = bits or SELECT_KERNEL_CONFIG["bound_bits"]
    num_warps = num_warps or SELECT_KERNEL_CONFIG["bound_warps"]
    if not 1 <= k <= G or 32 % bits:
        raise ValueError(f"bound_pallas: need 1 <= k ({k}) <= groups ({G}) and bits ({bits}) dividing 32")
    Gp = 1 << (G - 1).bit_length()
    extra = {} if interpret else dict(compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1))
    return pl.pallas_call(
        functools.partial(_bound_kernel, P=P, G=G, Gp=Gp, k=k, bits=bits,
                          matrix=bool(SELECT_KERNEL_CONFIG["bound_matrix"]),
                          early_exit=bool(SELECT_KERNEL_CONFIG["early_exit"])), grid=(R,),
        in_specs=[pl.BlockSpec((R, P, G), lambda i: (0, 0, 0))], out_specs=pl.BlockSpec((1,), lambda i: (i,)),
        out_shape=jax.ShapeDtypeStruct((R,), jnp.int32), interpret=interpret, name="topk_bound", **extra,
    )(gmax.astype(jnp.int32))


def _select_kernel(n_ref, keys_ref, pos_ref, keys_out, pos_out, *, W, Cp, k, kp, bits, finite_only, matrix,
                   early_exit):
    """One program per row: of the row's n valid slots (ascending position), keep the exact top-k set -- every key
    > K* and the first k' - #{key > K*} keys == K* (k' = min(k, n), K* = the k'-th largest) -- and write it in
    ascending position to [0, k'), padding (INT32_MIN, 0) in [k', k). finite_only: picks whose score is not finite
    (+inf / NaN keys; -inf never survives the compaction) are left out, so the padding starts at the number of
    finite picks. Lanes not stored go to distinct tail slots k + lane (the interpreter implements a masked scatter
    as read-select-write)."""
    r = pl.program_id(0)
    n = n_ref[r]
    lanes = jax.lax.iota(jnp.int32, Cp)
    inside = (lanes < n) & (lanes < W)
    key = plgpu.load(keys_ref.at[r, lanes], mask=inside, other=INT32_MIN)
    pos = plgpu.load(pos_ref.at[r, lanes], mask=inside, other=0)
    _write_topk_set(keys_out, pos_out, r, key, pos, lanes, n, k=k, kp=kp, bits=bits, matrix=matrix,
                    early_exit=early_exit, finite_only=finite_only)


def _write_topk_set(keys_out, pos_out, r, key, pos, lanes, n, *, k, kp, bits, matrix, early_exit, finite_only):
    """`_select_kernel`'s selection on in-register slots key / pos [Cp] (lanes [Cp]; valid: lanes < n): writes row
    r's exact top-k set to keys_out / pos_out [R, k + Cp] in ascending slot order, padding in [k', k)."""
    valid = lanes < n
    kk = jnp.minimum(n, k)
    kstar, c_gt = _radix_select_regs(key, valid, jnp.maximum(kk, 1), bits, matrix, early_exit)
    gt = valid & (key > kstar)
    eq = valid & (key == kstar)
    sel = _take_set(gt, eq, kk - c_gt)
    if finite_only:
        sel = sel & (key < POS_INF_KEY)
    n_out = jnp.sum(sel.astype(jnp.int32))
    at = jnp.where(sel, jnp.cumsum(sel.astype(jnp.int32)) - 1, k + lanes)
    plgpu.store(keys_out.at[r, at], key, mask=sel)
    plgpu.store(pos_out.at[r, at], pos, mask=sel)
    pad_lanes = jax.lax.iota(jnp.int32, kp)
    pad = (pad_lanes >= n_out) & (pad_lanes < k)
    plgpu.store(keys_out.at[r, pad_lanes], jnp.full((kp,), INT32_MIN, jnp.int32), mask=pad)
    plgpu.store(pos_out.at[r, pad_lanes], jnp.zeros((kp,), jnp.int32), mask=pad)


def select_pallas(cand_keys, cand_pos, n, k: int, capacity: int, *, bits: int | None = None,
                  num_warps: int | None = None, finite_only: bool = False, interpret: bool = False):
    """Raw slot buffers [R, >= capacity] (valid slots [0, n), n <= capacity, ascending position) -> (keys [R, k],
    pos [R, k]): the exact top-k set among the valid slots (ties -> lower slot) in ascending position, padded with
    (INT32_MIN, 0) past min(n, k) (finite_only: the set's +inf / NaN keys left out, padding after the rest). One
    Triton kernel, no sort."""
    R, W = cand_keys.shape
    bits = bits or SELECT_KERNEL_CONFIG["select_bits"]
    num_warps = num_warps or SELECT_KERNEL_CONFIG["select_warps"]
    if not 1 <= k <= capacity <= W or 32 % bits:
        raise ValueError(f"select_pallas: need 1 <= k ({k}) <= capacity ({capacity}) <= slots ({W}), bits | 32")
    Cp = 1 << (capacity - 1).bit_length()
    kp = 1 << (k - 1).bit_length()
    full = lambda shape: pl.BlockSpec(shape, lambda i: (0,) * len(shape))
    extra = {} if interpret else dict(compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1))
    keys_k, pos_k = pl.pallas_call(
        functools.partial(_select_kernel, W=W, Cp=Cp, k=k, kp=kp, bits=bits, finite_only=finite_only,
                          matrix=bool(SELECT_KERNEL_CONFIG["select_matrix"]),
                          early_exit=bool(SELECT_KERNEL_CONFIG["early_exit"])), grid=(R,),
        in_specs=[full((R,)), full((R, W)), full((R, W))], out_specs=[full((R, k + Cp))] * 2,
        out_shape=[jax.ShapeDtypeStruct((R, k + Cp), jnp.int32)] * 2, interpret=interpret, name="topk_select",
        **extra,
    )(jnp.minimum(n, capacity).astype(jnp.int32), cand_keys, cand_pos)
    return keys_k[:, :k], pos_k[:, :k]


def as_index_set(picks):
    """Sorted picks [..., k] (-1 = none) -> the same picks in ascending index order, the -1s last."""
    big = jnp.iinfo(jnp.int32).max
    ordered = jnp.sort(jnp.where(picks < 0, big, picks), axis=-1)
    return jnp.where(ordered == big, -1, ordered).astype(jnp.int32)


THRESHOLD_IMPLS = ("xla", "pallas_compact", "pallas", "pallas_select", "pallas_fused", "pallas_regions", "pallas_hist",
                   "pallas_tour")


def topk_threshold(scores, k: int, *, capacity: Optional[int] = None, impl: str = "xla", sorted: bool = True,
                   group_max=None, interpret: bool = False):
    """scores [..., T] float32 (-inf = invalid) -> picks [..., min(k, T)] int32, bit-identical to
    `topk_from_scores(scores, min(k, T), topk="lax")`; with sorted=False, the same picks as an index set:
    `as_index_set` of them (ascending index, the -1s last), which is what a gather-and-sum consumer needs.

    1. tau = the k-th largest of the maxima of ~2k..4k strided groups of scores: a lower bound of the k-th largest
       score (`_threshold`);
    2. compact the entries >= tau (and above -inf) in ascending position into `capacity` (default 4k) slots;
    3. order the slots, ties -> lower slot = lower position (as lax over the row).
    Every top-k entry is >= tau and all entries >= tau are kept, so the picks are exact; entries at or below -inf
    are dropped since they can only give -1 picks (and so does padding). For i.i.d. scores ~1.4k entries survive
(fewer for rows with only a prefix above -inf);
    a row with more than `capacity` survivors (heavy ties, adversarial layouts) gets the exact top-k by another
    route: impl "xla" sends the whole call to the exact grouped path (lax.cond), the Triton impls fix such rows up
    in place with `exact_rows` (radix select in one program per overflowing row; a no-op launch otherwise), so
    the GPU pipeline has no conditional (which would sync with the host). Same picks either way, slower.
    impl: "xla" (cumsum + scatter compaction, lax.top_k for tau and the order: any backend), "pallas_compact"
    (Triton compaction kernel, lax.top_k), "pallas" (Triton compaction and `rank_select` for tau and the order:
    no sort at all), "pallas_select" (Triton kernels instead of both sorts: `bound_pallas` for tau (the k-th largest
    group maximum by radix select), the compaction and fix-up, then `select_pallas` picks
    the exact top-k set among the ~1.4k survivors by radix select; the order is a `lax.top_k` over those k only,
    and none at all with sorted=False), "pallas_fused" (the same selection as "pallas_select" in one Triton kernel,
    one program per row: `topk_fused.fused_select`; group_max unused), "pallas_regions" (the same selection in two
    Triton kernels: bound + compaction into per-chunk regions, then the fix-up and the selection;
    `topk_regions.regions_select`), "pallas_hist" (no bound, no compaction: one Triton program per row selects the
    k-set by radix select with 11-bit histogram digits and writes it in index order, `topk_hist.hist_select`;
    group_max unused; it skips the small-row shortcut: any row longer than k), "pallas_tour" (the same kernel as a
    tournament: each segment of a long row keeps its own top-k set, one program per segment, then one program per
    row selects among those; `topk_hist.tournament_select`); `interpret` runs the Triton kernels in the Pallas
    interpreter.
    group_max: [..., P, G] int32, partial maxima of the ordered keys (`_ordered_i32`) of the scores' strided groups
    (group g = entries g, g + G, ...; G = `threshold_groups(T, k)`), whose max over P is the group maxima; a
    producer that already passed over the scores (the indexer scores kernel) saves the XLA pass over the row.
    Ignored when G == 0 (the small-row shortcut)."""
    if impl not in THRESHOLD_IMPLS:
        raise ValueError(f"unknown impl {impl!r}; expected one of {THRESHOLD_IMPLS}")
    s, lead, k = _as_rows(scores, k)
    if k == 0:
        return jnp.zeros(lead + (0,), jnp.int32)
    T = s.shape[1]
    R = s.shape[0]
    group, capacity = threshold_layout(T, k, capacity)
    bounded = T > capacity and group >= 4   # else the small-row shortcut: a plain lax.top_k
    gpart = None
    if group_max is not None and bounded:
        G = -(-T // group)
        if group_max.shape[:-2] != lead or group_max.shape[-1] != G or group_max.dtype != jnp.int32:
            raise ValueError(f"group_max must be int32 [*{lead}, P, {G}] (G = threshold_groups({T}, {k})), got "
                             f"{group_max.dtype} {group_max.shape}")
        gpart = group_max.reshape(R, group_max.shape[-2], G)
    if impl == "pallas_select" and bounded:
        return _select_path(s, lead, k, group, capacity, sorted, interpret, gpart)
    if impl == "pallas_regions" and bounded:
        from .topk_regions import regions_select   # the same k-set as "pallas_select", in two kernels

        if gpart is None:   # one XLA pass over the row: its group maxima as a single partial
            gpart = _strided_group_max(_ordered_i32(s), group)[:, None, :]
        keys_k, pos_k = regions_select(s, gpart, k, capacity, finite_only=not sorted, interpret=interpret)
        if not sorted:
            return jnp.where(keys_k > NEG_INF_KEY, pos_k, -1).reshape(lead + (k,))
        return _order_slots(keys_k, pos_k, k, lead)
    if impl in ("pallas_hist", "pallas_tour") and T > k:
        # the same k-set, no bound; also on rows short enough for the small-row shortcut, where it is faster than
        # lax.top_k (H200, session 34: 64 x 2048, k = 512: ~3 vs ~20 us net). pallas_tour: segments first.
        from .topk_hist import hist_select, tournament_select

        select = tournament_select if impl == "pallas_tour" else hist_select
        if not sorted:
            return select(s, k, finite_only=True, set_out=True, interpret=interpret).reshape(lead + (k,))
        keys_k, pos_k = select(s, k, interpret=interpret)
        return _order_slots(keys_k, pos_k, k, lead)
    if impl == "pallas_fused" and bounded:
        from .topk_fused import fused_select   # the same k-set as "pallas_select", in one kernel

        keys_k, pos_k = fused_select(s, k, capacity, finite_only=not sorted, interpret=interpret)
        if not sorted:
            return jnp.where(keys_k > NEG_INF_KEY, pos_k, -1).reshape(lead + (k,))
        return _order_slots(keys_k, pos_k, k, lead)
    picks = _threshold_sorted(s, lead, k, group, capacity, impl, interpret, gpart)
    return picks if sorted else as_index_set(picks)


def _compact_fixed(s, keys, tau, k: int, capacity: int, interpret: bool):
    """The Triton impls' compaction + overflow fix-up: raw slot buffers (cand_keys, cand_pos) and n [R], the valid
    slots of each row (an overflowing row holds exactly its k picks, so n = k there)."""
    sub = 1024
    raw_keys, raw_pos, n = _compact_raw(s, keys, tau, capacity, 2048, sub, interpret)
    raw_keys, raw_pos = exact_rows(s, n, tau, raw_keys, raw_pos, k, capacity, chunk=sub, interpret=interpret)
    return raw_keys, raw_pos, jnp.where(n > capacity, k, n)


def _order_slots(cand_keys, cand_pos, k: int, lead):
    """Slots [R, C] (ascending position, padding INT32_MIN) -> picks [*lead, k] sorted by key, ties -> lower slot =
    lower position; -1 where the picked key is not a finite score (the slots' keys say so: no gather of the
    scores, unlike _finite_picks)."""
    key, slot = jax.lax.top_k(cand_keys, k)
    ok = (key > NEG_INF_KEY) & (key < POS_INF_KEY)
    idx = jnp.where(ok, jnp.take_along_axis(cand_pos, slot, axis=1), -1)
    return idx.astype(jnp.int32).reshape(lead + (k,))


def _select_path(s, lead, k: int, group: int, capacity: int, sorted: bool, interpret: bool, gpart=None):
    """topk_threshold(impl="pallas_select") past its small-row shortcut (gpart: partial group maxima [R, P, G])."""
    keys = _ordered_i32(s)
    tau = bound_pallas(_strided_group_max(keys, group) if gpart is None else gpart, k, interpret=interpret)
    raw_keys, raw_pos, n = _compact_fixed(s, keys, tau, k, capacity, interpret)
    keys_k, pos_k = select_pallas(raw_keys, raw_pos, n, k, capacity, finite_only=not sorted, interpret=interpret)
    if not sorted:  # ascending position, non-finite picks left out, padding (INT32_MIN) after them
        return jnp.where(keys_k > NEG_INF_KEY, pos_k, -1).reshape(lead + (k,))
    return _order_slots(keys_k, pos_k, k, lead)


def _threshold_sorted(s, lead, k: int, group: int, capacity: int, impl: str, interpret: bool, gpart=None):
    """topk_threshold with sorted picks for the impls "xla", "pallas_compact", "pallas" (and every impl's small
    rows: T <= capacity or groups of < 4). gpart: partial group maxima [R, P, G] (reduced over P here)."""
    R, T = s.shape
    keys = _ordered_i32(s)
    if T <= capacity or group < 4:
        return _finite_picks(s, jax.lax.top_k(keys, k)[1], lead)
    gmax = _strided_group_max(keys, group) if gpart is None else jnp.max(gpart, axis=1)
    if impl == "pallas":
        G = gmax.shape[1]
        gpad = -(-G // 128) * 128 - G
        gmax = jnp.pad(gmax, ((0, 0), (0, gpad)), constant_values=INT32_MIN)
        tau = rank_select(gmax, gmax, jnp.full((R,), G, jnp.int32), k, interpret=interpret)[:, k - 1]
    else:
        tau = _threshold(keys, k, group, gmax)
    if impl == "xla":
        cand_keys, cand_pos, n = compact_reference(keys, tau, capacity)

        def order(_):
            slot = jax.lax.top_k(cand_keys, k)[1]
            return jnp.where(slot < n[:, None], jnp.take_along_axis(cand_pos, slot, axis=1), -1)

        # overflow (any row with n > capacity): the exact grouped path. A conditional is cheap on the CPU; the GPU
        # impls below fix overflowing rows up in a kernel instead (a GPU conditional syncs with the host)
        idx = jax.lax.cond(jnp.any(n > capacity), lambda _: _grouped_positions(keys, k, group, 8192), order, None)
        return _finite_picks(s, idx, lead)
    raw_keys, raw_pos, n = _compact_fixed(s, keys, tau, k, capacity, interpret)
    cand_keys, cand_pos = _finish_slots(raw_keys, raw_pos, n, capacity)
    if impl == "pallas":
        # padding slots (>= n) hold INT32_MIN, below -inf's key: their picks are -1
        idx = rank_select(cand_keys, jnp.where(cand_keys > NEG_INF_KEY, cand_pos, -1), n, k, interpret=interpret)
        return _finite_picks(s, idx, lead)
    return _order_slots(cand_keys, cand_pos, k, lead)
