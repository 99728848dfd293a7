"""Exact top-k by radix select (no sort over T): the indexer's decode-path alternative to `lax.top_k`.

    topk_radix(scores [..., T] f32, k, *, bits_per_pass=8) -> picks [..., min(k, T)] int32

Contract: bit-identical to `gpu.topk_from_scores(scores, k, topk="lax")` (the k highest scores sorted descending,
ties -> lower index, then -1 where the picked score is not finite), for every input.

`lax.top_k` orders float32 by XLA's *total order* (the comparator bitcasts to int and flips the magnitude bits of
negatives): -NaN < -inf < ... < -0.0 < +0.0 < ... < +inf < +NaN, so -0.0 and +0.0 are NOT tied (+0.0 ranks
above -0.0 even at a higher index), and NaNs have a definite rank. The key map below is that same total order
on uint32, so no special case is needed for signed zeros, and NaN inputs give the same picks as `lax.top_k` too
(their picks come out as -1, like +inf ones, since the final mask is `isfinite`). The indexer never produces
NaN / +inf; -inf marks invalid entries.

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

import jax
import jax.numpy as jnp

__all__ = ["float_keys", "kth_largest_key", "topk_radix"]

PACK_LIMIT = 2 ** 31  # one packed int32 cumsum while (T + 1) * M stays below this (a module constant for tests)


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
    scores = jnp.asarray(scores)
    lead, T = scores.shape[:-1], scores.shape[-1]
    k = min(int(k), T)
    if k <= 0:
        return jnp.zeros(lead + (0,), jnp.int32)
    s = scores.astype(jnp.float32).reshape((-1, T))
    keys = float_keys(s)
    kstar, c_gt = kth_largest_key(keys, k, bits_per_pass)
    cand = _compact_selected(keys, kstar, c_gt, k)                                       # [R, k] ascending
    vals, order = jax.lax.top_k(jnp.take_along_axis(s, cand, axis=1), k)
    idx = jnp.take_along_axis(cand, order, axis=1)
    picks = jnp.where(jnp.isfinite(vals), idx, -1).astype(jnp.int32)
    return picks.reshape(lead + (k,))
