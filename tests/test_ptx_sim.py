"""The selection's inline PTX (`pallas_kernels/indexer/mosaic_select.py`) run on the CPU by a small PTX interpreter
(`tests/ptx_sim.py`): each block's results against the numpy model of its rule, bit for bit. ptxas (test_indexer_
segment_select.py) checks that the blocks assemble; this checks what they compute, which otherwise only the H200
could. Threads run in a seeded random order between collectives, and unwritten registers hold seeded garbage, so a
missing barrier or a result that depends on garbage differs between seeds."""

from __future__ import annotations

import numpy as np
import pytest

from ptx_sim import Cta, Memory
from tiers import full, full_tier
from pallas_kernels.indexer import mosaic_select as M
from pallas_kernels.indexer.topk import INT32_MIN

U0, S0, P0 = 0x1000, 0x40000, 0x60000          # shared: u keys (+ positions after them), scratch, positions
GK, GP, GS, GC = 0x100000, 0x200000, 0x300000, 0x400000   # global: survivors' keys / positions, the set, counters


def _scores(rng, n, kind):
    s = rng.standard_normal(n).astype(np.float32)
    if kind == "ties":          # a few distinct values: long runs of equal keys
        s = rng.integers(-3, 4, n).astype(np.float32)
    elif kind == "holes":       # masked (-inf) entries and a masked tail
        s[rng.random(n) < 0.3] = -np.inf
        s[n - n // 5:] = -np.inf
    elif kind == "nonfinite":   # +inf / NaN / -0.0 among them
        s[rng.integers(0, n, 5)] = np.inf
        s[rng.integers(0, n, 3)] = np.nan
        s[rng.integers(0, n, 7)] = -0.0
    elif kind == "few":         # fewer valid entries than k
        s[:] = -np.inf
        s[rng.integers(0, n, 9)] = rng.standard_normal(9)
    elif kind == "close":       # within a few ulps of each other: the last radix level decides
        s = (1.0 + rng.integers(0, 64, n) * np.float32(2.0 ** -23)).astype(np.float32)
    return s


def _u(scores):
    return (M._ordered(scores).astype(np.int64) ^ INT32_MIN) & 0xFFFFFFFF


IDX = 0x70000   # shared: the pruned selection's candidate list


def _stream(cta, u, *, bt=128, aggregate=False, prune=None):
    """A split's stream as the kernel runs it, block by block: the block's u keys into shared memory, counted into
    the first level; with prune = (J, k, cap), counted up to block J only, the threshold after block J and each
    later block's candidates appended."""
    cta.run(M.hist_zero_ptx(), [S0])
    for j, first in enumerate(range(0, len(u), bt)):
        block = u[first:first + bt]
        cta.shared.write_array(U0 + 4 * first, block)
        if prune is None or j <= prune[0]:
            cta.run(M.hist_block_ptx(len(block), aggregate), [U0, S0, first])
        if prune is not None and j == prune[0]:
            cta.run(M.prune_start_ptx(prune[1], prune[2]), [U0, S0, first + bt, IDX])
        if prune is not None and j > prune[0]:
            cta.run(M.prune_append_ptx(bt, prune[2]), [U0, S0, first, IDX])


def _run_split(cta, scores, pos0, k, slots, *, hist_ready, out="global_pairs", pos_in="implicit", gk=GK, gp=GP,
               bt=128, aggregate=False, stream_cta=None):
    """One split CTA: its u keys into shared memory, the streamed histogram (hist_ready; run by stream_cta's
    threads where given: another view of the same shared memory), then the selection (by cta's threads)."""
    n = len(scores)
    if hist_ready:
        _stream(cta if stream_cta is None else stream_cta, _u(scores), bt=bt, aggregate=aggregate)
    else:
        cta.shared.write_array(U0, _u(scores))
    pos_op = pos0
    if pos_in == "smem":
        cta.shared.write_array(P0, pos0 + np.arange(n))
        pos_op = P0
    outs = {"global_pairs": [gk, gp], "smem_pairs": [GK, GP], "global_set": [GS]}[out]
    cta.run(M.segment_select_ptx(k, slots, hist_ready=hist_ready, pos_in=pos_in, out=out, aggregate=aggregate,
                                 threads=cta.n), [U0, S0, n, pos_op] + outs)
    assert not cta.uninitialized, f"registers read before written: {sorted(cta.uninitialized)}"


def _exact_set(scores, k):
    """The top-k index set (key desc, position asc) among the candidates (> -inf), its finite picks ascending,
    -1 padding: `as_index_set` of lax.top_k's picks."""
    key = M._ordered(scores).astype(np.int64)
    idx = np.nonzero(key > M.NEG_INF_KEY)[0]
    top = idx[np.lexsort((idx, -key[idx]))][:k]
    top = np.sort(top[np.isfinite(scores[top])])
    return np.concatenate([top, np.full(k - len(top), -1)]).astype(np.int64)


@pytest.mark.parametrize("kind", ["normal", "ties", full("holes"), "nonfinite", full("few"), "close"])
@pytest.mark.parametrize("hist_ready,pos_in,aggregate", [(True, "implicit", False), full(False, "smem", False),
                                                         full(True, "implicit", True)])
def test_segment_select_ptx_matches_the_model(kind, hist_ready, pos_in, aggregate):
    """A split's survivors (out "global_pairs": ordered keys and positions, padding (INT32_MIN, 0)) equal
    `segment_select_model`'s, for every score pattern, with the first level streamed block by block or counted
    after, positions implicit or in shared memory, the histogram's atomics aggregated per bin (match.any) or not;
    two thread orders."""
    rng = np.random.default_rng(hash((kind, hist_ready, pos_in)) % 2 ** 32)
    n, k, slots, pos0 = 1024, 48, 80, 777
    scores = _scores(rng, n, kind)
    want_k, want_p = M.segment_select_model(scores, pos0, k, slots)
    for seed in (1, 2):
        cta = Cta(shared=Memory(), glob=Memory(), seed=seed)
        _run_split(cta, scores, pos0, k, slots, hist_ready=hist_ready, pos_in=pos_in, aggregate=aggregate)
        np.testing.assert_array_equal(cta.glob.read_array(GK, slots), want_k, err_msg=f"keys, seed {seed}")
        np.testing.assert_array_equal(cta.glob.read_array(GP, slots), want_p, err_msg=f"positions, seed {seed}")


@pytest.mark.parametrize("kind,n", [("normal", 1024), ("ties", 1024), full("holes", 896), ("nonfinite", 640),
                                    full("few", 1024), ("close", 1536), ("normal", 0), full("normal", 256)])
@pytest.mark.parametrize("out", ["global_pairs", full("global_set")])
def test_two_warpgroup_selection_matches_the_model(kind, n, out):
    """gpu_mosaic's select_wgs 2 (session 76): both warpgroups (%tid.x 0-255, 8 warps, the pair barrier) run the
    selection after the converter warpgroup counted the streamed first level (wg_local, %tid.x 128-255). Survivors
    equal `segment_select_model`'s (and the exact set with out "global_set"), bit for bit, for every score pattern,
    segments that leave some of the 8 warps' parts empty (n 0, 256, 640) included, two thread orders; and equal the
    one-warpgroup block's."""
    rng = np.random.default_rng(hash((kind, n, out)) % 2 ** 32)
    k, slots, pos0 = (48, 80, 777) if out == "global_pairs" else (40, 40, 0)
    scores = _scores(rng, n, kind) if n else np.zeros(0, np.float32)
    results = []
    for threads, seed in ((256, 1), (256, 2), (128, 1)):
        shared = Memory()
        cta = Cta(threads=threads, shared=shared, glob=Memory(), seed=seed,
                  bar_id=M.PAIR_BARRIER if threads == 256 else 1)
        conv = Cta(shared=shared, glob=cta.glob, seed=seed, tid_base=128)   # the converter warpgroup's view
        stream_cta = None
        if threads == 256:   # the converter counts the stream (wg_local), as with seg_hist "converter"
            stream_cta = _WgLocal(conv)
        _run_split(cta, scores, pos0, k, slots, hist_ready=True, out=out, stream_cta=stream_cta)
        if out == "global_pairs":
            results.append((cta.glob.read_array(GK, slots), cta.glob.read_array(GP, slots)))
        else:
            results.append((cta.glob.read_array(GS, k),))
    if out == "global_pairs":
        want = M.segment_select_model(scores, pos0, k, slots)
    else:
        want = (_exact_set(scores, k) if n else np.full(k, -1),)
    for got in results:
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)


class _WgLocal:
    """A Cta whose hist_zero / hist_block blocks are the converter's (wg_local) versions: `_stream` runs them."""

    def __init__(self, cta):
        self.cta, self.shared = cta, cta.shared

    def run(self, asm, operands):
        swap = {M.hist_zero_ptx(): M.hist_zero_ptx(True)}
        swap.update({M.hist_block_ptx(bt, agg): M.hist_block_ptx(bt, agg, True) for bt in (128, 64, 0)
                     for agg in (False, True)})
        if asm not in swap:
            raise AssertionError("the converter only zeroes and counts the histogram")
        self.cta.run(swap[asm], operands)


def test_two_warpgroup_selection_halves_the_busiest_thread():
    """What select_wgs 2 is for: over a split of 8192 entries (the fp4 kernel's at B = 64 x 128K) whose scores need
    every radix level, the busiest thread of the 256-thread block executes well under 60% of the 128-thread
    block's instructions (the count and compaction passes split over 8 warps; the bin searches' per-thread bins
    halve)."""
    rng = np.random.default_rng(76)
    n = 8192
    scores = (1.0 + rng.integers(0, 4096, n) * np.float32(2.0 ** -23)).astype(np.float32)   # every level
    u = _u(scores)
    longest = {}
    for threads in (128, 256):
        cta = Cta(threads=threads, shared=Memory(), glob=Memory(), bar_id=M.PAIR_BARRIER if threads == 256 else 1)
        cta.shared.write_array(U0, u)
        hist = Cta(shared=cta.shared, glob=cta.glob)
        _stream(hist, u)
        cta.run(M.segment_select_ptx(512, 576, hist_ready=True, threads=threads), [U0, S0, n, 0, GK, GP])
        want_k, want_p = M.segment_select_model(scores, 0, 512, 576)
        np.testing.assert_array_equal(cta.glob.read_array(GK, 576), want_k)
        np.testing.assert_array_equal(cta.glob.read_array(GP, 576), want_p)
        longest[threads] = cta.longest
    assert longest[256] < 0.6 * longest[128], longest


def test_two_warpgroup_selection_needs_its_barrier():
    """The two-warpgroup block syncs the pair barrier over 256 threads (not a warpgroup's own barrier); the
    simulator refuses any other, and the pruned / index-list selection stays one warpgroup's."""
    asm = M.segment_select_ptx(48, 80, threads=256)
    assert f"bar.sync {M.PAIR_BARRIER}, 256;" in asm and "bar.sync 1," not in asm
    assert M.segment_select_ptx(48, 80) == M.segment_select_ptx(48, 80, threads=128)
    cta = Cta(threads=256, shared=Memory(), glob=Memory(), bar_id=1)
    cta.shared.write_array(U0, _u(np.random.default_rng(0).standard_normal(512).astype(np.float32)))
    with pytest.raises(AssertionError, match="bar.sync"):
        cta.run(asm, [U0, S0, 512, 0, GK, GP])
    with pytest.raises(ValueError, match="threads"):
        M.segment_select_ptx(48, 80, threads=256, pos_in="index")
    with pytest.raises(ValueError, match="threads"):
        M.segment_select_ptx(48, 80, threads=192)


@pytest.mark.parametrize("aggregate", [False, True])
def test_hist_blocks_in_the_second_warpgroup(aggregate):
    """gpu_mosaic's seg_hist "converter" (session 75): the fp4 converter warpgroup (%tid.x 128-255) zeroes and
    counts the first level's histogram (wg_local: tid mod 128); its counters and state words equal the scoring
    warpgroup's (%tid.x 0-127), block by block, for ragged blocks too."""
    rng = np.random.default_rng(75 + aggregate)
    u = _u(_scores(rng, 1000, "nonfinite"))
    counts, stale = [], rng.integers(0, 2 ** 31, M.STATE // 4 + 8)
    for tid_base, wg_local in ((0, False), (128, True)):
        cta = Cta(shared=Memory(), glob=Memory(), seed=3, tid_base=tid_base)
        cta.shared.write_array(S0, stale)   # stale words: the counters and the state words are zeroed first
        cta.run(M.hist_zero_ptx(wg_local), [S0])
        for first in range(0, len(u), 128):
            block = u[first:first + 128]
            cta.shared.write_array(U0 + 4 * first, block)
            cta.run(M.hist_block_ptx(len(block), aggregate, wg_local), [U0, S0, first])
        words = cta.shared.read_array(S0, M.STATE // 4 + 8, signed=False)
        counts.append(words[:M.BINS] + words[M.STATE // 4:])
    np.testing.assert_array_equal(counts[1], counts[0])
    assert sum(counts[0][:M.BINS]) == np.sum(u > M.U_INVALID) and not any(counts[0][M.BINS:])


@pytest.mark.parametrize("kind", ["normal", full("ties"), "nonfinite", full("few")])
def test_segment_select_ptx_exact_set(kind):
    """With slots = k and out "global_set" the block writes the exact top-k index set (the cluster and "last"
    finals' output): ascending finite picks, -1 after."""
    rng = np.random.default_rng(hash(kind) % 2 ** 32)
    n, k = 768, 40
    scores = _scores(rng, n, kind)
    cta = Cta(shared=Memory(), glob=Memory(), seed=3)
    _run_split(cta, scores, 0, k, k, hist_ready=False, out="global_set", pos_in="smem")
    np.testing.assert_array_equal(cta.glob.read_array(GS, k), _exact_set(scores, k))


@pytest.mark.parametrize("n_split,kind,pruned", [(4, "normal", False), full(3, "ties", False),
                                                 full(5, "holes", False), (2, "few", False), (4, "normal", True),
                                                 full(3, "ties", True)])
def test_last_final_ptx_selects_the_rows_set(n_split, kind, pruned):
    """SELECT_CONFIG final "last": the row's split CTAs, each with its own shared memory, select their survivors into
    global memory (plain or pruned selection) and arrive at the row's counter in a random order; the one that arrives
    last (and only it) writes the row's exact top-k set. Three arrival orders; the counter ends at n_split."""
    rng = np.random.default_rng(n_split * 31 + len(kind))
    seg, k, slack, row = 512, 40, 24, 3
    slots = k + slack
    scores = _scores(rng, n_split * seg, kind)
    want = _exact_set(scores, k)
    survivors = Memory()   # every split's survivors (they do not depend on the arrival order): selected once
    for j in range(n_split):
        cta = Cta(shared=Memory(), glob=survivors, seed=j)
        part, where = scores[j * seg:(j + 1) * seg], dict(gk=GK + 4 * j * slots, gp=GP + 4 * j * slots)
        if pruned:   # 4 blocks of 128: the threshold after block 1
            _run_pruned(cta, part, j * seg, k, slots, bt=128, J=1, cap=256, **where)
        else:
            _run_split(cta, part, j * seg, k, slots, hist_ready=True, **where)
    for order_seed in range(3):
        glob = Memory()
        glob.words = dict(survivors.words)
        glob.write_array(GC, [0] * 8)                      # the semaphore array, zero at launch
        glob.write_array(GS, [-7] * k)                     # poison: the set must be written
        order = np.random.default_rng(order_seed).permutation(n_split)
        for arrival, j in enumerate(order):
            cta = Cta(shared=Memory(), glob=glob, seed=10 * order_seed + arrival)
            before = glob.read_array(GS, k)
            cta.run(M.last_final_ptx(n_split, slots, k), [U0, S0, n_split * slots, U0 + 4 * n_split * slots, GS,
                                                          GC - 4 * row, GK, GP, row])
            assert not cta.uninitialized, sorted(cta.uninitialized)
            if arrival < n_split - 1:                      # not the last: the set is untouched
                assert glob.read_array(GS, k) == before
        np.testing.assert_array_equal(glob.read_array(GS, k), want, err_msg=f"arrival order {order}")
        assert glob.read_array(GC, 1)[0] == n_split


@full_tier
def test_the_simulator_catches_a_missing_barrier():
    """The harness itself: the selection with its first barrier (every key and count in place) removed reads
    a histogram still being counted, and a thread order exposes it (or a deadlock does)."""
    rng = np.random.default_rng(5)
    n, k, slots = 1024, 48, 80
    scores = _scores(rng, n, "normal")
    asm = M.segment_select_ptx(k, slots, hist_ready=False)
    broken = asm.replace("bar.sync 1, 128;", "", 2)   # the first two: before and after the first count
    want_k, _ = M.segment_select_model(scores, 0, k, slots)
    outcomes = []
    for seed in range(4):
        cta = Cta(shared=Memory(), glob=Memory(), seed=seed)
        cta.shared.write_array(U0, _u(scores))
        try:
            cta.run(broken, [U0, S0, n, 0, GK, GP])
            outcomes.append(np.array_equal(cta.glob.read_array(GK, slots), want_k))
        except AssertionError:
            outcomes.append(False)
    assert not all(outcomes)


def _run_pruned(cta, scores, pos0, k, slots, *, bt, J, cap, out="global_pairs", gk=GK, gp=GP):
    """One split CTA with pruning, as the kernel runs it: block by block its u keys, the first level counted up to
    block J, the threshold after block J and each later block's candidates, then the selection."""
    n_blocks = len(scores) // bt
    _stream(cta, _u(scores), bt=bt, prune=(J, k, cap))
    outs = [gk, gp] if out == "global_pairs" else [0x80000, 0x90000]
    cta.run(M.prune_final_ptx(k, slots, out=out), [U0, S0, n_blocks * bt, IDX] + outs + [pos0])
    assert not cta.uninitialized, f"registers read before written: {sorted(cta.uninitialized)}"
    mem = cta.glob if out == "global_pairs" else cta.shared
    return mem.read_array(outs[0], slots), mem.read_array(outs[1], slots)


@pytest.mark.parametrize("kind,bt,n_blocks,cap,expect", [
    ("normal", 128, 8, 512, "candidates"), ("ties", 128, 8, 512, "candidates"),
    full("holes", 64, 12, 512, "candidates"), ("nonfinite", 256, 4, 1024, "candidates"),
    full("few", 128, 6, 256, "candidates"),
    ("close", 128, 8, 400, "overflow at the threshold"),
    ("normal", 128, 8, None, "overflow in a later block"),   # cap: the first half's candidates + 8
    ("normal", 128, 3, 512, "not engaged")])
def test_pruned_selection_ptx_matches_its_model(kind, bt, n_blocks, cap, expect):
    """SELECT_CONFIG prune: the threshold after the first half's blocks (the first level's bin of their k-th
    largest), later blocks' candidates appended as they stream, the selection over the candidate list; the
    survivors equal `segment_select_pruned_model`'s bit for bit, and contain the split's exact top-k set. Also the
    fallbacks: candidates over the list's capacity at the threshold or in a later block, and a split too short to
    reach the threshold's block (the selection runs over the whole split). Two thread orders."""
    rng = np.random.default_rng(hash((kind, bt, n_blocks, cap)) % 2 ** 32)
    k, slots, pos0, J = 48, 80, 4096, 3    # J: the kernel's bps // 2 - 1 for 8 blocks
    scores = _scores(rng, bt * n_blocks, kind)
    n_first = (J + 1) * bt
    if n_blocks > J:   # the candidates with no capacity limit, and those among the first half's entries
        every = M.prune_candidates(scores, n_first, k, 1 << 30)
        first = int(np.sum(every < n_first))
        cap = first + 8 if cap is None else cap
        assert {"candidates": len(every) <= cap, "overflow at the threshold": first > cap,
                "overflow in a later block": first <= cap < len(every)}[expect], (first, len(every), cap)
    want = (M.segment_select_pruned_model(scores, pos0, k, slots, n_first, cap) if n_blocks > J else
            M.segment_select_model(scores, pos0, k, slots))
    exact = _exact_set(scores, k)
    for seed in (1, 2):
        got_k, got_p = _run_pruned(Cta(shared=Memory(), glob=Memory(), seed=seed), scores, pos0, k, slots, bt=bt,
                                   J=J, cap=cap)
        np.testing.assert_array_equal(got_k, want[0], err_msg=f"keys, seed {seed}")
        np.testing.assert_array_equal(got_p, want[1], err_msg=f"positions, seed {seed}")
        assert set(exact[exact >= 0] + pos0) <= set(np.asarray(got_p)[np.asarray(got_k) != INT32_MIN])


def test_pruned_selection_ptx_shared_outputs():
    """The pruned selection into shared memory (out "smem_pairs", the cluster final's input): u keys and positions,
    padding (0, 0)."""
    rng = np.random.default_rng(11)
    k, slots, bt, J, cap = 32, 64, 128, 3, 512
    scores = _scores(rng, 8 * bt, "normal")
    got_u, got_p = _run_pruned(Cta(shared=Memory(), glob=Memory(), seed=4), scores, 0, k, slots, bt=bt, J=J,
                               cap=cap, out="smem_pairs")
    want_k, want_p = M.segment_select_pruned_model(scores, 0, k, slots, (J + 1) * bt, cap)
    want_u = np.where(want_k == INT32_MIN, 0, want_k ^ INT32_MIN)
    np.testing.assert_array_equal(np.asarray(got_u, np.int64) & 0xFFFFFFFF, np.asarray(want_u, np.int64) & 0xFFFFFFFF)
    np.testing.assert_array_equal(got_p, want_p)


def test_select_ptx_counts_script():
    """benchmarks/select_ptx_counts.py (the per-thread instruction counts behind the pruned selection's expected
    gain) runs, and the pruned tail issues fewer instructions and collectives than the plain one."""
    from benchmarks.select_ptx_counts import counts

    res = counts(n=2048, k=128, slack=64, cap=1024)
    assert 0 < res["candidates"] <= 1024
    assert res["pruned"][1] < res["plain"][1] and res["pruned"][2] < res["plain"][2], res


@pytest.mark.parametrize("n_split", [4, full(3)])
def test_cluster_final_ptx_selects_the_rows_set(n_split):
    """SELECT_CONFIG final "cluster": every split CTA of the row's cluster selects its survivors into its own shared
    memory (out "smem_pairs"); CTA 0 gathers them all through distributed shared memory (`gather_ptx`: mapa +
    ld.shared::cluster) and selects the row's exact top-k set (out "global_set")."""
    rng = np.random.default_rng(90 + n_split)
    seg, k, slack = 512, 40, 24
    slots = k + slack
    scores = _scores(rng, n_split * seg, "normal")
    SU, SP = S0, S0 + 4 * slots                    # each CTA's survivors in its scratch's start, as the kernel has them
    cluster = [Memory() for _ in range(n_split)]
    glob = Memory()
    for j in range(n_split):
        cta = Cta(shared=cluster[j], glob=glob, seed=j, cluster=cluster, rank=j)
        cta.shared.write_array(U0, _u(scores[j * seg:(j + 1) * seg]))
        cta.run(M.segment_select_ptx(k, slots, out="smem_pairs"), [U0, S0, seg, j * seg, SU, SP])
    W = n_split * slots
    cta0 = Cta(shared=cluster[0], glob=glob, seed=99, cluster=cluster, rank=0)
    cta0.run(M.gather_ptx(n_split, slots), [SU, SP, U0, U0 + 4 * W])
    glob.write_array(GS, [-7] * k)
    cta0.run(M.segment_select_ptx(k, k, pos_in="smem", out="global_set"), [U0, S0, W, U0 + 4 * W, GS])
    assert not cta0.uninitialized, sorted(cta0.uninitialized)
    np.testing.assert_array_equal(glob.read_array(GS, k), _exact_set(scores, k))
