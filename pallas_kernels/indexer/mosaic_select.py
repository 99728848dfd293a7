"""A segment's top-k superset selected inside the Mosaic indexer scores kernel (`gpu_mosaic.py`, `select_k`): the
tournament's first stage (`topk_hist.tournament_stage`) moved into the CTA that computed the scores.

    segment_select(u_smem, scratch_smem, n, pos, out0, out1, *, k, slots, ...)   (inside the kernel)
    segment_select_model(scores [n] f32, pos0, k, slots) -> (keys [slots] i32, pos [slots] i32)   (numpy, same rule)

Why: at B = 64 x 128K context (fp8 keys) the scores kernel streams the keys in ~89 us and the tournament top-k runs
after it as two more Triton kernels (~20 us for 512 segment programs, ~9 us for the final one per row, session 36),
so the call ends at ~1.7x its byte floor. Every scores CTA already holds one split of a row (8192 keys at the
default 4 splits); here it keeps that split's scores in shared memory (32 KB), and after its last block selects
their top-k superset and writes only that (k + slack (key, position) pairs) instead of the 8192 scores. The final
per-row selection (`topk_hist.hist_select` with a position map) then reads 4 x 576 survivors a row instead of 32768
scores. The selection runs after each CTA's last block, on data in shared memory.

Measured on the H200 (session 40, benchmarks/results/README_indexer_compressor.md). The whole fp8 call at
B = 64 x 128K takes 122.5 us, against 125.0 with the tournament (fp4 128.3 vs 134.5; bf16 slower, 186.6 vs 180.4).
`gpu.segment_auto_takes` says where "auto_set" takes it. In CUPTI terms the kernel saves the tournament's 18 us
segment kernel and pays ~14 us itself:
- ~8.8 us of selection after the stream, which no CTA overlaps: the 256 CTAs are one wave and all end together;
- ~5.3 us of slower streaming: the first histogram level's atomics crowd into a few bins.

The rule (one CTA, entries i < n of the segment; position of entry i = pos0 + i). An entry's key is the ordered int32
of its score (`topk._ordered_i32`: signed order = XLA's float total order); valid = key above -inf's key (masked keys
are -inf; entries at or below it can only give -1 picks). u = key ^ 2^31 (unsigned order = signed order of keys).
1. Radix select over u, `LEVELS` = 11, 11 and 10 bits from the top. At each level, a shared-memory histogram
   (atomics) of the digit of the valid entries whose higher digits equal the prefix P found so far; the bin b of the
   `need`-th largest (a suffix scan over the bins), P = P.b, and the entries in higher bins are counted as surely
   picked (cgt += above, need -= above). Stop after a level where cgt + (entries in b) <= slots (they all fit), or
   after the last level (P = the k-th largest key itself). A segment with fewer than k valid entries takes them all.
2. The output, in ascending position: every valid entry whose prefix (at the last level's resolution) is above P,
   and the first slots - cgt entries whose prefix equals P; padding (INT32_MIN, 0) after. Every entry among the
   segment's top k (by key, then lower position) is in it, so the row's top-k set is among the rows' survivors and
   ties still go to the lower position (the survivors of the row's segments lie in ascending position).
In PTX (one inline-asm block, 128 threads = the kernel's one warpgroup): the histograms by `red.shared.add`, the bin
search by a warp-shuffle suffix scan and one exchange through shared memory, the ordered compaction by warp ballots
(4 consecutive entries a lane, lane-major order, `vote.ballot` + `popc` with `%lanemask_lt`), a count pass and a
write pass over 4 contiguous quarters of the segment (one per warp), the quarters' offsets from their counts.
threads=256 (session 76, `gpu_mosaic`'s select_wgs 2): the same block run by both warpgroups of the fp4 converter
kernel, 8 warps and 8 parts, synced by a named barrier of its own (PAIR_BARRIER); on tests/ptx_sim.py its busiest
thread runs ~55% of the one-warpgroup block's instructions over an 8192-entry split.

Two variants built in session 41 (no GPU that session; off by default, `gpu_mosaic.SELECT_CONFIG`):
* final "last" (`last_final_ptx`): the split CTA that arrives last at its row's counter selects the row's set among
  every split's survivors in the same kernel (no Triton final, no CTA waits).
* prune (`prune_start_ptx`, `prune_append_ptx`, `prune_final_ptx`; model `segment_select_pruned_model`): after the
  split's first half, the first level's bin of its k-th largest bounds the split's top k from below; later blocks
  append only their keys at or above it to a candidate list as they stream, and the selection after the last block
  runs over the list (~1.3K of 8192 entries for normal scores) unless it overflowed.

Exactness is the numpy models' (`segment_select_model`, `segment_select_pruned_model`, checked against `lax.top_k`
sets on the CPU). The PTX is assembled by ptxas on the CPU (where ptxas is found) and run on the CPU by
`tests/ptx_sim.py`, a small PTX interpreter, against the models bit for bit (`tests/test_ptx_sim.py`); the plain
selection also on the H200 (session 40).
"""

from __future__ import annotations

import numpy as np

from .topk import INT32_MIN, NEG_INF_KEY

LEVELS = ((21, 11), (10, 11), (0, 10))     # (shift, width) of each radix digit of u, from the top
BINS = 1 << max(w for _, w in LEVELS)     # histogram counters (u32) in the scratch
SCRATCH_WORDS = BINS + 32                  # + the exchange words: [BINS, +4) warp totals, +8.. the bin found,
#                                            +16.. / +20.. the quarters' counts
THREADS = 128
SELECT_THREADS = (128, 256)                # the selection's threads: the scoring warpgroup, or both (seg_hist
#                                            "converter": the converter warpgroup joins it after its last block)
PAIR_BARRIER = 15                          # the named barrier of the two-warpgroup selection: Mosaic GPU's own are
#                                            0 (the CTA) and 1 + w (warpgroup w's); the one-warpgroup selection uses
#                                            1, its warpgroup's own, as that warpgroup is the only one to take it
STATE = 4 * BINS + 96                      # the pruned selection's words (bytes into the scratch): +0 tau, +4 the
PRUNE_TAU, PRUNE_COUNT, PRUNE_MODE, PRUNE_X = STATE, STATE + 4, STATE + 8, STATE + 16   # candidates, +8 mode
#                                            (0 not engaged, 1 candidates, 2 overflow), +16..+31 warp counts


def _ordered(scores):   # numpy twin of `topk._ordered_i32` (the model runs eagerly on the host)
    bits = np.asarray(scores, np.float32).view(np.int32)
    return bits ^ ((bits >> 31) & np.int32(0x7FFFFFFF))


def segment_select_model(scores, pos0: int, k: int, slots: int, positions=None):
    """numpy model of the kernel's rule (module doc): scores [n] float32 -> (keys [slots] int32, pos [slots] int32),
    the kept entries in ascending position, (INT32_MIN, 0) padding after. positions (int [n], ascending): entry i's
    position instead of pos0 + i."""
    key = _ordered(scores)
    valid = key > NEG_INF_KEY
    u = (key.astype(np.int64) ^ INT32_MIN) & 0xFFFFFFFF        # as unsigned, in int64
    need, cgt, P = k, 0, 0
    shift = LEVELS[0][0]
    for level, (s, w) in enumerate(LEVELS):
        match = valid & ((u >> (s + w)) == P)
        hist = np.bincount(((u[match] >> s) & ((1 << w) - 1)).astype(np.int64), minlength=1 << w)
        total = int(hist.sum())
        if total < need:                                      # fewer than need: take all (level 1 only)
            b, above, inb = 0, 0, total
        else:
            suffix = np.cumsum(hist[::-1])[::-1]              # entries in bins >= b
            b = int(np.nonzero(suffix >= need)[0].max())
            above = int(suffix[b] - hist[b])
            inb = int(hist[b])
        P = (P << w) | b
        cgt += above
        need -= above
        shift = s
        if cgt + inb <= slots or level == len(LEVELS) - 1:
            break
    hi = u >> shift
    gt = valid & (hi > P)
    eq = valid & (hi == P)
    quota = slots - int(gt.sum())
    keep = gt | (eq & (np.cumsum(eq) - 1 < quota))
    idx = np.nonzero(keep)[0]
    if len(idx) > slots:
        raise AssertionError(f"{len(idx)} entries kept for {slots} slots")
    keys = np.full(slots, INT32_MIN, np.int32)
    pos = np.zeros(slots, np.int32)
    keys[:len(idx)] = key[idx]
    pos[:len(idx)] = pos0 + idx if positions is None else np.asarray(positions)[idx]
    return keys, pos


def prune_candidates(scores, n_first: int, k: int, cap: int):
    """numpy model of the pruned selection's candidates (`prune_start_ptx` / `prune_append_ptx`): the first-level
    bin b of the k-th largest among entries [0, n_first) (all candidates when fewer than k are valid there); the
    candidates are the valid entries with u >= b << 21, in order. None where they exceed cap (the selection then
    runs over the whole segment)."""
    key = _ordered(scores)
    valid = key > NEG_INF_KEY
    u = (key.astype(np.int64) ^ INT32_MIN) & 0xFFFFFFFF
    s, w = LEVELS[0]
    first = u[:n_first][valid[:n_first]]
    if len(first) < k:
        tau = 0
    else:
        tau = (int(np.sort(first >> s)[::-1][k - 1])) << s
    idx = np.nonzero(valid & (u >= tau))[0]
    return None if len(idx) > cap else idx


def segment_select_pruned_model(scores, pos0: int, k: int, slots: int, n_first: int, cap: int):
    """numpy model of the pruned selection (SELECT_CONFIG prune): `segment_select_model` over the candidates
    (`prune_candidates`) with their positions, or over the whole segment where they overflow cap."""
    idx = prune_candidates(scores, n_first, k, cap)
    if idx is None:
        return segment_select_model(scores, pos0, k, slots)
    return segment_select_model(np.asarray(scores)[idx], 0, k, slots, positions=pos0 + idx)


U_INVALID = 0x007FFFFF                     # u of -inf: entries at or below it are not candidates
U_POS_INF = 0xFF800000                     # u of +inf: finite entries lie strictly between the two
OUTS = ("global_pairs", "smem_pairs", "global_set")


def _zero_bins(base: str, nb: int, threads: int = THREADS):
    """PTX lines: `threads` threads zero the nb u32 counters at shared address `base` (tid, tid + threads, ...);
    needs tid, ad."""
    return ["mad.lo.u32 ad, tid, 4, " + base + ";"] + [f"st.shared.u32 [ad+{4 * threads * m}], 0;"
                                                        for m in range(nb // threads)]


def _count(bin_: str, pred: str, base: str, aggregate: bool):
    """PTX lines: counter `bin_` at shared address `base` += 1 where `pred` (clobbered). aggregate: the lanes of a
    warp that hit one bin add once (`match.any` groups them, the lowest lane adds the group's size; lanes without
    pred share key ~0, no bin's). Needs ad, kb, mm, t, lt (= %lanemask_lt)."""
    lines = [f"mad.lo.u32 ad, {bin_}, 4, {base};"]
    if not aggregate:
        return lines + [f"@{pred} red.shared.add.u32 [ad], 1;"]
    return lines + [f"selp.b32 kb, {bin_}, 0xFFFFFFFF, {pred};", "match.any.sync.b32 mm, kb, 0xffffffff;",
                    "and.b32 t, mm, lt;", f"setp.eq.and.u32 {pred}, t, 0, {pred};", "popc.b32 t, mm;",
                    f"@{pred} red.shared.add.u32 [ad], t;"]


def _barrier(threads: int) -> str:
    """The block's barrier over its `threads` threads: barrier 1 (its warpgroup's own) for one warpgroup,
    PAIR_BARRIER for both."""
    return "bar.sync 1, 128;" if threads == THREADS else f"bar.sync {PAIR_BARRIER}, {threads};"


def _load_words(a, reg: str, offset: int, count: int):
    """PTX lines (through `a`): registers reg0..reg{count - 1} = the u32 words at byte `offset` of the scratch ($1),
    16 B at a time."""
    for v in range(count // 4):
        a(f"ld.shared.v4.u32 {{{reg}{4 * v}, {reg}{4 * v + 1}, {reg}{4 * v + 2}, {reg}{4 * v + 3}}}, "
          f"[$1+{offset + 16 * v}];")


def _sum(dst: str, terms) -> str:
    """A PTX line: dst = the sum of terms (>= 2 registers)."""
    return f"add.u32 {dst}, {terms[0]}, {terms[1]}; " + " ".join(f"add.u32 {dst}, {dst}, {t};" for t in terms[2:])


def _bin_search(a, per: int, X: int, threads: int = THREADS):
    """PTX lines (through `a`): the bin of the need-th largest count in the histogram at the scratch ($1, nb /
    threads = per bins a thread), by a per-thread sum, a warp-shuffle suffix scan and one exchange at byte X (the
    warps' totals at [X, X + 4 W), the bin found at X + 32; W = threads / 32 <= 8): afterwards every thread holds
    bst (the bin), abv (entries in the bins above it), inb (in it) and tot (all counted); with fewer than need
    counted, bin 0 with inb = tot. Needs the select block's registers (tid, lane, warp, need, cnt*, w*, ...); ends
    past a barrier over the block's threads."""
    W = threads // 32
    bar = _barrier(threads)
    # this thread's bins [tid * per, tid * per + per): their sum, then a suffix scan over the threads
    a(f"mul.lo.u32 base, tid, {per};")
    a("mad.lo.u32 ha, base, 4, $1;")
    for jj in range(per):
        a(f"ld.shared.u32 cnt{jj}, [ha+{4 * jj}];")
    a("mov.u32 st, cnt0;")
    for jj in range(1, per):
        a(f"add.u32 st, st, cnt{jj};")
    a("mov.u32 x, st;")
    for d in (1, 2, 4, 8, 16):
        a(f"shfl.sync.down.b32 y, x, {d}, 31, 0xffffffff;")   # lanes past 31 keep their own x
        a(f"setp.lt.u32 p, lane, {32 - d};")
        a("@p add.u32 x, x, y;")
    a("setp.eq.u32 p, lane, 0;")
    a("mad.lo.u32 ad, warp, 4, $1;")
    a(f"@p st.shared.u32 [ad+{X}], x;")
    a(bar)
    _load_words(a, "w", X, W)
    a(_sum("tot", [f"w{i}" for i in range(W)]))
    a("mov.u32 exc, 0;")                                   # entries in the warps above this one
    for i in reversed(range(1, W)):
        a(f"setp.lt.u32 p, warp, {i}; @p add.u32 exc, exc, w{i};")
    a("add.u32 exc, exc, x; sub.u32 exc, exc, st;")        # ... + in this warp's threads above this one
    a("add.u32 t, exc, st;")
    a("setp.lt.u32 own, exc, need;")
    a("setp.ge.and.u32 own, t, need, own;")                 # the need-th largest is in this thread's bins
    a("mov.u32 acc, exc; mov.u32 bst, 0; mov.u32 abv, 0; mov.u32 inb, 0;")
    a("setp.ne.u32 fnd, tid, tid;")                         # false
    for jj in reversed(range(per)):
        a(f"add.u32 t, acc, cnt{jj};")
        a("setp.ge.u32 q, t, need;")
        a("and.pred q, q, !fnd;")
        a(f"@q add.u32 bst, base, {jj};")
        a("@q mov.u32 abv, acc;")
        a(f"@q mov.u32 inb, cnt{jj};")
        a("or.pred fnd, fnd, q;")
        a("mov.u32 acc, t;")
    a(f"@own st.shared.v4.u32 [$1+{X + 32}], {{bst, abv, inb, bst}};")
    a("setp.lt.u32 p, tot, need;")                          # fewer than need: all of them (bin 0 and up)
    a("setp.eq.and.u32 p, tid, 0, p;")
    a("mov.u32 t, 0;")
    a(f"@p st.shared.v4.u32 [$1+{X + 32}], {{t, t, tot, t}};")
    a(bar)
    a(f"ld.shared.v4.u32 {{bst, abv, inb, t2}}, [$1+{X + 32}];")


def segment_select_ptx(k: int, slots: int, *, aggregate: bool = False, hist_ready: bool = False,
                       pos_in: str = "implicit", out: str = "global_pairs", compact: bool = True,
                       threads: int = THREADS) -> str:
    """The selection block with its documented operands $0..$5 (see `_select_body`)."""
    return _select_body(k, slots, aggregate=aggregate, hist_ready=hist_ready, pos_in=pos_in, out=out,
                        compact=compact, threads=threads)


def _select_body(k: int, slots: int, *, aggregate: bool = False, hist_ready: bool = False,
                 pos_in: str = "implicit", out: str = "global_pairs", compact: bool = True, ops=None,
                 tag: str = "", n_smem: bool = False, threads: int = THREADS) -> str:
    """The selection as one PTX block for `threads` threads (128: one warpgroup, %tid.x 0-127; 256: two, 0-255), over
    u keys (u32 [n] in shared memory: `_ordered` ^ 2^31, at most U_INVALID for entries that are no candidates). Operands: $0 u (shared u32 address, 16 B aligned), $1 scratch
    (shared u32 address, u32 [SCRATCH_WORDS], 16 B aligned), $2 n (entries, a multiple of 4), $3 pos0 (pos_in
    "implicit": entry i is at position pos0 + i) or the shared address of int32 positions [n] (pos_in "smem"),
    $4 / $5 the outputs:
      out "global_pairs": generic 64-bit pointers to int32 [slots] keys (ordered int32, `topk._ordered_i32`'s) and
                          positions, padding (INT32_MIN, 0);
      out "smem_pairs":   shared u32 addresses of u32 [slots] u keys and int32 positions, padding (0, 0);
      out "global_set":   $4 a generic pointer to int32 [slots] positions of the finite kept entries, ascending,
                          -1 padding after (slots = k: the exact top-k index set, `as_index_set`'s layout); no $5.
                          The kept entries are staged in the scratch's histogram area first (slots <= BINS / 2).
    threads 256 (the two warpgroups of a converter kernel, `gpu_mosaic`'s select_wgs 2): every pass over the
    entries and every bin search split over 8 warps, its barriers PAIR_BARRIER over both warpgroups; the exchange
    words then fill the scratch's last 128 bytes (the pruned selection's state words among them: pos_in "index"
    and the pruned selection keep 128 threads).
    hist_ready: the first level's histogram is already in the scratch (`hist_block_ptx` during the stream).
    aggregate: the histogram's lanes that hit one bin add once (`match.any` groups them, the lowest lane adds the
    group's size): fewer conflicting shared-memory atomics where the scores crowd into a few bins.
    compact=False (a timing probe, `SELECT_CONFIG["probe"]` 2): the histogram levels and bin searches only; the
    block ends where the compaction would start and writes no output.
    pos_in "index" (the pruned selection, `prune_final_ptx`): $3 is the shared address of an int32 index list, entry
    i is the segment's entry idx[i] (u = $0[idx[i]], position pos0 + idx[i], pos0 = operand $6); entries past n
    hold u 0 whatever the list holds there.
    ops: the operands standing for $0..$6 (default: themselves); n_smem: the operand for $2 is the shared address of
    n, not n; tag: appended to the labels, so two selections can share one asm block."""
    if not 1 <= k <= slots:
        raise ValueError(f"segment_select: need 1 <= k ({k}) <= slots ({slots})")
    if slots >= 1 << 24:
        raise ValueError(f"segment_select: slots {slots} too large")
    if out == "global_set" and 2 * slots > BINS:
        raise ValueError(f"segment_select: out 'global_set' stages <= {BINS // 2} entries, got slots {slots}")
    if out not in OUTS or pos_in not in ("implicit", "smem", "index"):
        raise ValueError(f"segment_select: out must be one of {OUTS} and pos_in 'implicit', 'smem' or 'index', got "
                         f"{out!r}, {pos_in!r}")
    if threads not in SELECT_THREADS or (threads != THREADS and pos_in == "index"):
        raise ValueError(f"segment_select: threads must be one of {SELECT_THREADS} (pos_in 'index': {THREADS}), got "
                         f"{threads} (pos_in {pos_in!r})")
    X = 4 * BINS                                               # byte offset of the exchange words
    W = threads // 32                                          # warps: the compaction's parts, the scan's totals
    assert X + 64 + 8 * W <= 4 * SCRATCH_WORDS                 # the parts' counts: [X + 64, + 4 W), then + 4 W
    bar = _barrier(threads)
    L = []
    a = L.append
    a("{")
    a(".reg .pred p, q, own, fnd, v0, v1, v2, v3, g0, g1, g2, g3, e0, e1, e2, e3, k0, k1, k2, k3, ration;")
    a(".reg .b32 tid, lane, warp, need, cgt, P, sh, i, j, t, t2, x, y, st, exc, acc, bst, abv, inb, ha, base, tot;")
    a(".reg .b32 u0, u1, u2, u3, hi, bin, ad, lt, c, start, pv0, pv1, pv2, pv3, ov;")
    a(".reg .b32 w0, w1, w2, w3, gc, ec, G, E, quota, ko, es, ktot, ek0, ek1, ek2, ek3, eo, r, m0, m1, m2, m3;")
    a(".reg .b32 b0, b1, b2, b3, n0, n1, n2, n3, rank, slot, rank0, slot0, pos;")
    a(".reg .b32 cnt<16>, kb, mm, wb;")
    if W > 4:   # the second warpgroup's warps: their totals, counts at P and kept entries at P
        a(".reg .b32 " + ", ".join(f"{r}{i}" for r in ("w", "n", "ek") for i in range(4, W)) + ";")
    a(".reg .b64 ka, pa, a64;")
    a(".reg .b32 pa32, nn, ix0, ix1, ix2, ix3;")
    a("mov.u32 tid, %tid.x;")
    a("and.b32 lane, tid, 31;")
    a("shr.u32 warp, tid, 5;")
    a("mov.u32 lt, %lanemask_lt;")
    a("ld.shared.u32 nn, [$2];" if n_smem else "mov.u32 nn, $2;")
    if out != "smem_pairs":
        a("cvta.to.global.u64 ka, $4;")
    if out == "global_pairs":
        a("cvta.to.global.u64 pa, $5;")
    if out == "global_set":   # the staged positions' shared address
        a(f"add.u32 pa32, $1, {4 * slots};")
    a(f"mov.u32 need, {k};")
    a("mov.u32 cgt, 0;")
    a("mov.u32 P, 0;")
    a(bar)                                                     # every key (and histogram count) is in place

    def load4(first, with_pos=False):   # u of entries first..first+3 (register `first`); past n: 0 (no candidate)
        a("mov.b32 u0, 0; mov.b32 u1, 0; mov.b32 u2, 0; mov.b32 u3, 0;")
        a(f"setp.lt.u32 p, {first}, nn;")
        if pos_in == "index":   # the list's 4 indices, then each entry's u where it is below n
            a("mov.b32 ix0, 0; mov.b32 ix1, 0; mov.b32 ix2, 0; mov.b32 ix3, 0;")
            a(f"mad.lo.u32 ad, {first}, 4, $3;")
            a("@p ld.shared.v4.b32 {ix0, ix1, ix2, ix3}, [ad];")
            for e in range(4):
                a(f"add.u32 t, {first}, {e};")
                a("setp.lt.u32 q, t, nn;")
                a(f"mad.lo.u32 ad, ix{e}, 4, $0;")
                a(f"@q ld.shared.u32 u{e}, [ad];")
                if with_pos:
                    a(f"add.u32 pv{e}, $6, ix{e};")
            return
        a(f"mad.lo.u32 ad, {first}, 4, $0;")
        a("@p ld.shared.v4.b32 {u0, u1, u2, u3}, [ad];")
        if with_pos and pos_in == "smem":
            a("mov.b32 pv0, 0; mov.b32 pv1, 0; mov.b32 pv2, 0; mov.b32 pv3, 0;")
            a(f"mad.lo.u32 ad, {first}, 4, $3;")
            a("@p ld.shared.v4.b32 {pv0, pv1, pv2, pv3}, [ad];")

    for lvl, (s, w) in enumerate(LEVELS):
        nb, per = 1 << w, (1 << w) // threads
        a(f"// level {lvl}: digit u[{s + w - 1}:{s}]")
        if not (lvl == 0 and hist_ready):
            L.extend(_zero_bins("$1", nb, threads))
            a(bar)
            # thread tid: entries 4 tid + 4 threads m .. + 3; the loop runs while the warp's first entry wb is
            # below n (the same trip count for every lane of a warp, as match.any needs)
            a("shl.b32 i, tid, 2;")
            a("shl.b32 wb, warp, 7;")
            a(f"DSV4SEL_CNT{lvl}:")
            a("setp.ge.u32 p, wb, nn;")
            a(f"@p bra DSV4SEL_CNTEND{lvl};")
            load4("i")
            for e in range(4):
                a(f"setp.gt.u32 q, u{e}, {U_INVALID};")
                if s + w < 32:
                    a(f"shr.b32 hi, u{e}, {s + w};")
                    a("setp.eq.and.u32 q, hi, P, q;")
                a(f"shr.b32 bin, u{e}, {s};" if s else f"mov.b32 bin, u{e};")
                a(f"and.b32 bin, bin, {nb - 1};")
                L.extend(_count("bin", "q", "$1", aggregate))
            a(f"add.u32 i, i, {4 * threads};")
            a(f"add.u32 wb, wb, {4 * threads};")
            a(f"bra DSV4SEL_CNT{lvl};")
            a(f"DSV4SEL_CNTEND{lvl}:")
            a(bar)
        _bin_search(a, per, X, threads)
        a(f"shl.b32 P, P, {w};")
        a("or.b32 P, P, bst;")
        a("add.u32 cgt, cgt, abv;")
        a("sub.u32 need, need, abv;")
        a(f"mov.u32 sh, {s};")
        if lvl < len(LEVELS) - 1:
            a("add.u32 t, cgt, inb;")
            a(f"setp.le.u32 p, t, {slots};")
            a("@p bra DSV4SEL_COMPACT;")
    # ordered compaction: warp wq takes the part [wq * c, wq * c + c), c = 128 * ceil(n / (128 W)) (W = 4: quarters)
    a("DSV4SEL_COMPACT:")
    if not compact:
        a("}")
        return _bind("\n".join(L), ops, tag)
    a(f"add.u32 c, nn, {128 * W - 1}; shr.u32 c, c, {(128 * W).bit_length() - 1}; shl.b32 c, c, 7;")
    a("mul.lo.u32 start, warp, c;")

    def classify():   # u0..u3 -> g (prefix above P), e (prefix at P) among the candidates
        for e in range(4):
            a(f"setp.gt.u32 v{e}, u{e}, {U_INVALID};")
            a(f"shr.b32 hi, u{e}, sh;")
            a(f"setp.gt.and.u32 g{e}, hi, P, v{e};")
            a(f"setp.eq.and.u32 e{e}, hi, P, v{e};")

    def lanes_below(pred, mask, acc):   # mask{e} = the warp's ballot of pred{e}; acc += its set lanes below this one
        a(f"mov.u32 {acc}, {acc}0;")
        for e in range(4):
            a(f"vote.sync.ballot.b32 {mask}{e}, {pred}{e}, 0xffffffff;")
            a(f"and.b32 t, {mask}{e}, lt; popc.b32 t, t; add.u32 {acc}, {acc}, t;")

    def store(index, base, value, pred=None, space="global"):   # int32 base[index] = value
        guard = f"@{pred} " if pred else ""
        if space == "global":
            a(f"mul.wide.u32 a64, {index}, 4;")
            a(f"add.u64 a64, {base}, a64;")
            a(f"{guard}st.global.b32 [a64], {value};")
        else:
            a(f"mad.lo.u32 ad, {index}, 4, {base};")
            a(f"{guard}st.shared.b32 [ad], {value};")

    a("mov.u32 gc, 0; mov.u32 ec, 0; mov.u32 j, 0;")
    a("DSV4SEL_CA:")
    a("setp.ge.u32 p, j, c;")
    a("@p bra DSV4SEL_CAEND;")
    a("add.u32 i, start, j; shl.b32 t, lane, 2; add.u32 i, i, t;")
    load4("i")
    classify()
    for e in range(4):
        a(f"vote.sync.ballot.b32 t, g{e}, 0xffffffff; popc.b32 t, t; add.u32 gc, gc, t;")
        a(f"vote.sync.ballot.b32 t, e{e}, 0xffffffff; popc.b32 t, t; add.u32 ec, ec, t;")
    a("add.u32 j, j, 128;")
    a("bra DSV4SEL_CA;")
    a("DSV4SEL_CAEND:")
    a("setp.eq.u32 p, lane, 0;")
    a("mad.lo.u32 ad, warp, 4, $1;")
    a(f"@p st.shared.u32 [ad+{X + 64}], gc;")
    a(f"@p st.shared.u32 [ad+{X + 64 + 4 * W}], ec;")
    a(bar)
    _load_words(a, "w", X + 64, W)          # entries above P, per part
    _load_words(a, "n", X + 64 + 4 * W, W)  # entries at P, per part
    a(_sum("G", [f"w{i}" for i in range(W)]))
    a(_sum("E", [f"n{i}" for i in range(W)]))
    a(f"mov.u32 quota, {slots}; sub.u32 quota, quota, G;")      # entries at P that fit, in position order
    a("setp.gt.u32 ration, E, quota;")                          # (uniform) only then are entries at P ranked
    # part q keeps min(max(quota - (entries at P in parts before q), 0), n_q) of its entries at P
    a("mov.u32 eo, 0;")
    for qq in range(W):
        a(f"sub.s32 r, quota, eo; max.s32 r, r, 0; min.s32 ek{qq}, r, n{qq}; add.u32 eo, eo, n{qq};")
    a("mov.u32 ko, 0; mov.u32 es, 0;")                          # this part's output offset and P-rank offset
    for qq in range(W - 1):
        a(f"setp.gt.u32 p, warp, {qq};")
        a(f"@p add.u32 ko, ko, w{qq}; @p add.u32 ko, ko, ek{qq}; @p add.u32 es, es, n{qq};")
    a(_sum("ktot", ["G"] + [f"ek{i}" for i in range(W)]))
    a("mov.u32 j, 0;")
    a("DSV4SEL_CB:")
    a("setp.ge.u32 p, j, c;")
    a("@p bra DSV4SEL_CBEND;")
    a("add.u32 i, start, j; shl.b32 t, lane, 2; add.u32 i, i, t;")
    load4("i", with_pos=True)
    classify()
    # rank of (lane, e) among the chunk's entries at P: lanes below (all 4 of each) + this lane's e' < e; only
    # when the entries at P do not all fit (ration), else every candidate at or above P is kept
    a("@!ration bra DSV4SEL_NORANK;")
    a("mov.u32 rank0, es;")
    lanes_below("e", "m", "rank")
    for e in range(4):
        a("setp.lt.u32 q, rank, quota;")
        a(f"and.pred q, q, e{e};")
        a(f"or.pred k{e}, g{e}, q;")
        a(f"selp.u32 t, 1, 0, e{e}; add.u32 rank, rank, t;")
    a("bra DSV4SEL_RANKED;")
    a("DSV4SEL_NORANK:")
    for e in range(4):
        a(f"or.pred k{e}, g{e}, e{e};")
    a("DSV4SEL_RANKED:")
    a("mov.u32 slot0, ko;")
    lanes_below("k", "b", "slot")
    for e in range(4):
        if pos_in in ("smem", "index"):
            a(f"mov.u32 pos, pv{e};")
        else:
            a(f"add.u32 pos, $3, i; add.u32 pos, pos, {e};")
        if out == "global_pairs":
            a(f"xor.b32 ov, u{e}, 0x80000000;")
            store("slot", "ka", "ov", f"k{e}")
            store("slot", "pa", "pos", f"k{e}")
        else:   # smem_pairs, or global_set's staging in the scratch: u at [0, slots), positions after
            store("slot", "$4" if out == "smem_pairs" else "$1", f"u{e}", f"k{e}", space="shared")
            store("slot", "$5" if out == "smem_pairs" else "pa32", "pos", f"k{e}", space="shared")
        a(f"selp.u32 t, 1, 0, k{e}; add.u32 slot, slot, t;")
    for e in range(4):
        a(f"popc.b32 t, b{e}; add.u32 ko, ko, t;")
        a(f"@ration popc.b32 t, m{e}; @ration add.u32 es, es, t;")   # m{e}: set on the ranking path only
    a("add.u32 j, j, 128;")
    a("bra DSV4SEL_CB;")
    a("DSV4SEL_CBEND:")
    if out == "global_set":   # warp 0: the staged picks' finite ones in order, then -1 for the rest
        a(bar)
        a("setp.ne.u32 p, warp, 0;")
        a("@p bra DSV4SEL_SETEND;")
        a("mov.u32 ko, 0; mov.u32 j, 0;")
        a("DSV4SEL_SET:")
        a(f"setp.ge.u32 p, j, {slots};")
        a("@p bra DSV4SEL_SETPAD;")
        a("add.u32 i, j, lane;")
        a("mov.u32 u0, 0; mov.u32 pos, 0;")
        a("setp.lt.u32 p, i, ktot;")
        a("mad.lo.u32 ad, i, 4, $1;")
        a("@p ld.shared.u32 u0, [ad];")
        a("mad.lo.u32 ad, i, 4, pa32;")
        a("@p ld.shared.u32 pos, [ad];")
        a(f"setp.lt.u32 q, u0, {U_POS_INF};")
        a("and.pred q, q, p;")
        a("vote.sync.ballot.b32 b0, q, 0xffffffff;")
        a("and.b32 t, b0, lt; popc.b32 t, t; add.u32 slot, ko, t;")
        store("slot", "ka", "pos", "q")
        a("popc.b32 t, b0; add.u32 ko, ko, t;")
        a("add.u32 j, j, 32;")
        a("bra DSV4SEL_SET;")
        a("DSV4SEL_SETPAD:")
        a("add.u32 i, ko, lane;")
        a("DSV4SEL_SETPADL:")
        a(f"setp.ge.u32 p, i, {slots};")
        a("@p bra DSV4SEL_SETEND;")
        store("i", "ka", -1)
        a("add.u32 i, i, 32;")
        a("bra DSV4SEL_SETPADL;")
        a("DSV4SEL_SETEND:")
        a("}")
        return _bind("\n".join(L), ops, tag)
    # padding past the kept entries
    a("add.u32 i, ktot, tid;")
    a("DSV4SEL_PAD:")
    a(f"setp.ge.u32 p, i, {slots};")
    a("@p bra DSV4SEL_PADEND;")
    if out == "global_pairs":
        store("i", "ka", INT32_MIN)
        store("i", "pa", 0)
    elif out == "smem_pairs":
        a("mov.u32 t, 0;")
        store("i", "$4", "t", space="shared")
        store("i", "$5", "t", space="shared")
    a(f"add.u32 i, i, {threads};")
    a("bra DSV4SEL_PAD;")
    a("DSV4SEL_PADEND:")
    a("}")
    return _bind("\n".join(L), ops, tag)


def _prune_regs(a):
    a(".reg .pred p, q, own, fnd, kp, k0, k1, k2, k3;")
    a(".reg .b32 tid, lane, warp, lt, need, base, ha, st, x, y, ad, w0, w1, w2, w3, tot, exc, t, t2, acc, bst, abv, "
      "inb, tau, cnt_, mode, i, j, u0, u1, u2, u3, m0, m1, m2, m3, rank, off, all_, ent;")
    a(".reg .b32 cnt<16>;")
    a("mov.u32 tid, %tid.x;")
    a("and.b32 lane, tid, 31;")
    a("shr.u32 warp, tid, 5;")
    a("mov.u32 lt, %lanemask_lt;")


def _warp_offsets(a, total: str):
    """PTX lines: lane 0 of each warp has stored its warp's count at the scratch's PRUNE_X + 4 warp; after a
    barrier every thread holds `off` (the counts of the warps below its own) and `total` (all four)."""
    a("bar.sync 1, 128;")
    a(f"ld.shared.v4.u32 {{w0, w1, w2, w3}}, [$1+{PRUNE_X}];")
    a(f"add.u32 {total}, w0, w1; add.u32 {total}, {total}, w2; add.u32 {total}, {total}, w3;")
    a("mov.u32 off, 0;")
    a("setp.gt.u32 p, warp, 0; @p add.u32 off, off, w0;")
    a("setp.gt.u32 p, warp, 1; @p add.u32 off, off, w1;")
    a("setp.gt.u32 p, warp, 2; @p add.u32 off, off, w2;")


def prune_start_ptx(k: int, cap: int) -> str:
    """The pruned selection's threshold, after the streamed first-level histogram holds the split's first n_first
    entries (SELECT_CONFIG prune; `prune_candidates` is its numpy model). Operands: $0 u (shared u32 [>= n_first]),
    $1 scratch, $2 n_first (a multiple of 4), $3 the candidate list (shared int32 [cap]).
    1. The first level's bin b of the k-th largest among them (`_bin_search`); tau = b << 21, or 0 when fewer than k
       are valid. Every entry of the split's top k has u >= tau (the first entries' k-th largest bounds the split's
       from below), so later entries below tau are no candidates.
    2. If the entries at or above tau (abv + inb, known from the histogram) fit cap: their indices, ascending, into
       the list (4 entries a thread per 512-entry chunk, ranks by warp ballots, the warps' offsets by one exchange);
       mode 1. Else mode 2 (overflow: the selection runs over the whole split).
    3. Thread 0 stores tau, the count and the mode in the scratch's state words; a barrier ends the block."""
    s, w = LEVELS[0]
    L = ["{"]
    a = L.append
    _prune_regs(a)
    a(f"mov.u32 need, {k};")
    a("bar.sync 1, 128;")                                   # every count of the first entries is in place
    _bin_search(a, BINS // THREADS, 4 * BINS)
    a("setp.lt.u32 p, tot, need;")
    a(f"shl.b32 tau, bst, {s};")
    a("@p mov.u32 tau, 0;")
    a("add.u32 cnt_, abv, inb;")
    a("@p mov.u32 cnt_, tot;")
    a(f"setp.gt.u32 p, cnt_, {cap};")
    a("selp.u32 mode, 2, 1, p;")
    a("@p bra DSV4PRS_STORE;")
    a("mov.u32 all_, 0;")                                   # candidates listed so far
    a("mov.u32 j, 0;")
    a("DSV4PRS_CHUNK:")
    a("setp.ge.u32 p, j, $2;")
    a("@p bra DSV4PRS_STORE;")
    a("shl.b32 i, tid, 2; add.u32 i, i, j;")
    a("mov.b32 u0, 0; mov.b32 u1, 0; mov.b32 u2, 0; mov.b32 u3, 0;")
    a("setp.lt.u32 p, i, $2;")
    a("mad.lo.u32 ad, i, 4, $0;")
    a("@p ld.shared.v4.b32 {u0, u1, u2, u3}, [ad];")
    for e in range(4):
        a(f"setp.gt.u32 k{e}, u{e}, {U_INVALID};")
        a(f"setp.ge.and.u32 k{e}, u{e}, tau, k{e};")
    a("mov.u32 rank, 0; mov.u32 t2, 0;")                    # rank: this lane's first candidate among the warp's
    for e in range(4):
        a(f"vote.sync.ballot.b32 m{e}, k{e}, 0xffffffff;")
        a(f"and.b32 t, m{e}, lt; popc.b32 t, t; add.u32 rank, rank, t;")
        a(f"popc.b32 t, m{e}; add.u32 t2, t2, t;")
    a("setp.eq.u32 p, lane, 0;")
    a("mad.lo.u32 ad, warp, 4, $1;")
    a(f"@p st.shared.u32 [ad+{PRUNE_X}], t2;")
    _warp_offsets(a, "tot")
    a("add.u32 off, off, all_; add.u32 off, off, rank;")
    for e in range(4):
        a(f"add.u32 ent, i, {e};")
        a("mad.lo.u32 ad, off, 4, $3;")
        a(f"@k{e} st.shared.u32 [ad], ent;")
        a(f"selp.u32 t, 1, 0, k{e}; add.u32 off, off, t;")
    a("add.u32 all_, all_, tot;")
    a("bar.sync 1, 128;")                                   # the warp counts are read before the next chunk's
    a("add.u32 j, j, 512;")
    a("bra DSV4PRS_CHUNK;")
    a("DSV4PRS_STORE:")
    a("setp.eq.u32 p, tid, 0;")
    a(f"@p st.shared.u32 [$1+{PRUNE_TAU}], tau;")
    a(f"@p st.shared.u32 [$1+{PRUNE_COUNT}], cnt_;")
    a(f"@p st.shared.u32 [$1+{PRUNE_MODE}], mode;")
    a("bar.sync 1, 128;")
    a("}")
    return "\n".join(L)


def prune_append_ptx(bt: int, cap: int) -> str:
    """One block's candidates into the list, for each block after the threshold's (SELECT_CONFIG prune), after the
    block's u keys are stored and a warpgroup barrier. Operands: $0 u (shared), $1 scratch, $2 the block's first
    entry, $3 the candidate list. In mode 1: the block's valid entries with u >= tau, ascending, after the list's
    count entries (ranks by ballots, the warps' offsets by one exchange); if they do not fit cap, mode 2 and the list
    stops growing. Thread 0 updates the count and mode after a barrier; a barrier ends the block."""
    L = ["{"]
    a = L.append
    _prune_regs(a)
    a(f"ld.shared.u32 mode, [$1+{PRUNE_MODE}];")
    a(f"ld.shared.u32 tau, [$1+{PRUNE_TAU}];")
    a(f"ld.shared.u32 cnt_, [$1+{PRUNE_COUNT}];")
    a("setp.ne.u32 p, mode, 1;")
    a("@p bra DSV4PRA_END;")
    for c in range(-(-bt // THREADS)):
        a(f"add.u32 i, tid, {c * THREADS};")
        a(f"setp.lt.u32 kp, i, {bt};")
        a("add.u32 i, i, $2;")
        a("mad.lo.u32 ad, i, 4, $0;")
        a("mov.u32 u0, 0;")
        a("@kp ld.shared.u32 u0, [ad];")
        a(f"setp.gt.u32 q, u0, {U_INVALID};")
        a("and.pred kp, kp, q;")
        a("setp.ge.and.u32 kp, u0, tau, kp;")
        a("vote.sync.ballot.b32 m0, kp, 0xffffffff;")
        a("and.b32 t, m0, lt; popc.b32 rank, t;")
        a("popc.b32 t2, m0;")
        a("setp.eq.u32 p, lane, 0;")
        a("mad.lo.u32 ad, warp, 4, $1;")
        a(f"@p st.shared.u32 [ad+{PRUNE_X}], t2;")
        _warp_offsets(a, "tot")
        a("add.u32 t, cnt_, tot;")
        a(f"setp.gt.u32 p, t, {cap};")
        a("@p mov.u32 mode, 2;")
        a("@!p mov.u32 cnt_, t;")
        a("sub.u32 off, t, tot; add.u32 off, off, rank;")    # the list's count before this chunk + rank
        for w in range(3):
            a(f"setp.gt.u32 q, warp, {w}; @q add.u32 off, off, w{w};")
        a("and.pred kp, kp, !p;")
        a("mad.lo.u32 ad, off, 4, $3;")
        a("@kp st.shared.u32 [ad], i;")
        a("bar.sync 1, 128;")                               # the warp counts are read before they are rewritten
        a("setp.ne.u32 p, mode, 1;")
        a("@p bra DSV4PRA_DONE;")
    a("DSV4PRA_DONE:")
    a("setp.eq.u32 p, tid, 0;")
    a(f"@p st.shared.u32 [$1+{PRUNE_COUNT}], cnt_;")
    a(f"@p st.shared.u32 [$1+{PRUNE_MODE}], mode;")
    a("bar.sync 1, 128;")
    a("DSV4PRA_END:")
    a("}")
    return "\n".join(L)


def prune_final_ptx(k: int, slots: int, *, out: str = "global_pairs", aggregate: bool = False) -> str:
    """The split's selection with pruning (SELECT_CONFIG prune): over the candidate list in mode 1 (pos_in "index",
    n = the list's count), else over the whole split (modes 0 and 2; the first level counted again: the streamed
    histogram stopped at the threshold's block). Operands: $0 u, $1 scratch, $2 n (the split's entries, a multiple
    of 4), $3 the candidate list, $4 / $5 the outputs of `out` ("global_pairs" or "smem_pairs"), $6 pos0 (the split's
    first position). Same survivors rule, over the candidates: `segment_select_pruned_model`."""
    if out not in ("global_pairs", "smem_pairs"):
        raise ValueError(f"prune_final: out must be 'global_pairs' or 'smem_pairs', got {out!r}")
    opts = dict(aggregate=aggregate, out=out, hist_ready=False)
    cand = _select_body(k, slots, pos_in="index", ops=["$0", "$1", f"$1+{PRUNE_COUNT}", "$3", "$4", "$5", "$6"],
                        n_smem=True, tag="C", **opts)
    whole = _select_body(k, slots, pos_in="implicit", ops=["$0", "$1", "$2", "$6", "$4", "$5"], tag="W", **opts)
    return "\n".join(["{", ".reg .pred dsv4_cand;", ".reg .b32 dsv4_mode;",
                      f"ld.shared.u32 dsv4_mode, [$1+{PRUNE_MODE}];", "setp.eq.u32 dsv4_cand, dsv4_mode, 1;",
                      "@!dsv4_cand bra DSV4PRF_WHOLE;", cand, "bra DSV4PRF_END;", "DSV4PRF_WHOLE:", whole,
                      "DSV4PRF_END:", "}"])


def _bind(asm: str, ops, tag: str) -> str:
    """A select block's text with its $i operands replaced by ops[i] (where given) and its labels tagged."""
    if tag:
        asm = asm.replace("DSV4SEL_", f"DSV4SEL{tag}_")
    if ops:
        for i in reversed(range(len(ops))):
            asm = asm.replace(f"${i}", f"@@{i}@@")
        for i, op in enumerate(ops):
            asm = asm.replace(f"@@{i}@@", op)
    return asm


def _thread_index(wg_local: bool):
    """PTX lines: tid = the thread's index; wg_local: within its warpgroup (a second warpgroup's threads count
    0-127 too)."""
    return ["mov.u32 tid, %tid.x;"] + (["and.b32 tid, tid, 127;"] if wg_local else [])


def hist_block_ptx(bt: int, aggregate: bool = False, wg_local: bool = False) -> str:
    """The first level's histogram of one block of bt u keys, run after the block is stored (during the stream):
    $0 u (shared u32 address of the segment's keys), $1 scratch (shared address, the histogram at its start), $2
    the block's first entry. Each thread counts entries tid, tid + 128, ... of the block. aggregate: as in
    `segment_select_ptx` (the lanes of a warp that hit one bin add once). wg_local: run by a warpgroup other than
    the CTA's first (tid taken mod 128; `gpu_mosaic`'s seg_hist "converter")."""
    s, w = LEVELS[0]
    L = ["{", ".reg .pred q;", ".reg .b32 tid, i, u, ad, bin, kb, mm, t, lt;", *_thread_index(wg_local),
         "mov.u32 lt, %lanemask_lt;"]
    for e in range(-(-bt // THREADS)):
        L.append(f"add.u32 i, tid, {e * THREADS};")
        L.append(f"setp.lt.u32 q, i, {bt};")
        L.append("add.u32 i, i, $2;")
        L.append("mad.lo.u32 ad, i, 4, $0;")
        L.append("mov.u32 u, 0;")
        L.append("@q ld.shared.u32 u, [ad];")
        L.append(f"setp.gt.u32 q, u, {U_INVALID};")
        L.append(f"shr.u32 bin, u, {s};")
        L.extend(_count("bin", "q", "$1", aggregate))
    L.append("}")
    return "\n".join(L)


def hist_zero_ptx(wg_local: bool = False) -> str:
    """Zero the first level's histogram ($0: the scratch's shared address) and the spare exchange words (the pruned
    selection's state: mode 0, not engaged), before the stream. wg_local: as in `hist_block_ptx`."""
    L = ["{", ".reg .pred p;", ".reg .b32 tid, ad;", *_thread_index(wg_local)] + _zero_bins("$0", BINS)
    L += ["setp.lt.u32 p, tid, 8;", "mad.lo.u32 ad, tid, 4, $0;", f"@p st.shared.u32 [ad+{STATE}], 0;", "}"]
    return "\n".join(L)


def gather_ptx(n_split: int, slots: int) -> str:
    """In the row's cluster CTA 0, between two cluster barriers: the survivors of every split CTA p (u keys at
    shared address $0, positions at $1, [slots] each, in every CTA) -> u keys [p * slots + i] at shared address $2
    and positions at $3 of this CTA, through distributed shared memory (mapa + ld.shared::cluster)."""
    L = ["{", ".reg .pred q;", ".reg .b32 tid, i, src, dst, ra, v;", "mov.u32 tid, %tid.x;"]
    for p in range(n_split):
        L.append("mov.u32 i, tid;")
        L.append(f"DSV4GATHER{p}:")
        L.append(f"setp.ge.u32 q, i, {slots};")
        L.append(f"@q bra DSV4GATHEREND{p};")
        for src_op, dst_op in (("$0", "$2"), ("$1", "$3")):
            L.append(f"mad.lo.u32 src, i, 4, {src_op};")
            L.append(f"mapa.shared::cluster.u32 ra, src, {p};")
            L.append("ld.shared::cluster.u32 v, [ra];")
            L.append(f"add.u32 dst, i, {p * slots};")
            L.append(f"mad.lo.u32 dst, dst, 4, {dst_op};")
            L.append("st.shared.u32 [dst], v;")
        L.append(f"add.u32 i, i, {THREADS};")
        L.append(f"bra DSV4GATHER{p};")
        L.append(f"DSV4GATHEREND{p}:")
    L.append("}")
    return "\n".join(L)


LAST_KINDS = "rrrrllllr"   # the operands of `last_final_ptx`


def last_final_ptx(n_split: int, slots: int, k: int) -> str:
    """The row's final selection by the split CTA that finishes last (SELECT_CONFIG final "last"), after this CTA
    wrote its survivors (`segment_select_ptx`, out "global_pairs"). Operands: $0 u / $1 scratch / $2 n = n_split *
    slots / $3 positions (shared addresses: the segment buffer's [0, n) and [n, 2n), the scratch) and $4 the set's
    output (int32 [k], generic pointer) as `segment_select_ptx(k, k, pos_in="smem", out="global_set")` takes them;
    $5 the row counters (a generic pointer to u32 [rows], zero before the kernel), $6 / $7 the row's survivors (keys,
    positions: int32 [n_split, slots], generic pointers), $8 the row.
    1. Every thread fences its survivor stores (fence.sc.gpu, CUDA's __threadfence) and joins the warpgroup barrier;
       thread 0 adds 1 to the row's counter (a relaxed atomic after the fences: a release; the pattern of CUDA's
       threadFenceReduction sample) and fences again (acquire), and passes the
       count it read through the scratch's first word.
    2. The CTA that read n_split - 1 is the row's last: every other split's survivors are visible to it. It fences,
       loads the row's n_split x slots survivors from global memory (L2: ld.global.cg; keys back to u keys, padding
       (INT32_MIN, 0) -> u 0, no candidate) into the segment buffer, and selects the row's set among them (the
       cluster final's selection). The other CTAs skip it. No CTA waits for another, so any grid size and order runs.
    slots must be a multiple of 4 (16-byte rows of survivors)."""
    if slots % 4:
        raise ValueError(f"last_final: slots ({slots}) must be a multiple of 4")
    n = n_split * slots
    L = ["{", ".reg .pred dsv4_last;", "{", ".reg .pred p;",
         ".reg .b32 tid, old, i, v0, v1, v2, v3, c0, c1, c2, c3, ad;", ".reg .b64 g, gk, gp, a64;",
         "mov.u32 tid, %tid.x;",
         "fence.sc.gpu;",                       # this thread's survivor stores, before the arrival
         "bar.sync 1, 128;",
         "setp.eq.u32 p, tid, 0;",
         "cvta.to.global.u64 g, $5;",
         "mul.wide.u32 a64, $8, 4;",
         "add.u64 g, g, a64;",
         "@p atom.global.add.u32 old, [g], 1;",
         "@p fence.sc.gpu;",
         "@p st.shared.u32 [$1], old;",
         "bar.sync 1, 128;",
         "ld.shared.u32 old, [$1];",
         f"setp.eq.u32 dsv4_last, old, {n_split - 1};",
         "@!dsv4_last bra DSV4LAST_SKIP;",
         "fence.sc.gpu;",
         "cvta.to.global.u64 gk, $6;",
         "cvta.to.global.u64 gp, $7;",
         "mov.u32 i, tid;",
         "DSV4LAST_LOAD:",
         f"setp.ge.u32 p, i, {n // 4};",
         "@p bra DSV4LAST_LOADED;",
         "mul.wide.u32 a64, i, 16;",
         "add.u64 g, gk, a64;",
         "ld.global.cg.v4.b32 {v0, v1, v2, v3}, [g];",
         "add.u64 g, gp, a64;",
         "ld.global.cg.v4.b32 {c0, c1, c2, c3}, [g];",
         "xor.b32 v0, v0, 0x80000000; xor.b32 v1, v1, 0x80000000;",
         "xor.b32 v2, v2, 0x80000000; xor.b32 v3, v3, 0x80000000;",
         "mad.lo.u32 ad, i, 16, $0;",
         "st.shared.v4.b32 [ad], {v0, v1, v2, v3};",
         "mad.lo.u32 ad, i, 16, $3;",
         "st.shared.v4.b32 [ad], {c0, c1, c2, c3};",
         "add.u32 i, i, 128;",
         "bra DSV4LAST_LOAD;",
         "DSV4LAST_LOADED:",
         "DSV4LAST_SKIP:",
         "}",
         "@!dsv4_last bra DSV4LAST_END;",
         segment_select_ptx(k, k, pos_in="smem", out="global_set"),
         "DSV4LAST_END:",
         "}"]
    return "\n".join(L)


def _operand_kinds(out: str):
    """The select block's operands ('r': 32-bit, 'l': 64-bit pointer) for an output mode."""
    return {"global_pairs": "rrrrll", "smem_pairs": "rrrrrr", "global_set": "rrrrl"}[out]


def standalone_ptx(blocks, arch: str = "sm_90a") -> str:
    """A PTX module with one kernel per (name, asm, operand kinds) in `blocks` (their $i operands from kernel
    parameters, 'r' u32 / 'l' u64), for assembling with ptxas on a machine without a GPU (tests)."""
    entries = []
    for name, body, kinds in blocks:
        params = ", ".join(f".param .{'u64' if t == 'l' else 'u32'} a{i}_param" for i, t in enumerate(kinds))
        decl = "\n".join(f".reg .{'b64' if t == 'l' else 'b32'} %a{i};" for i, t in enumerate(kinds))
        loads = "\n".join(f"ld.param.{'u64' if t == 'l' else 'u32'} %a{i}, [a{i}_param];"
                          for i, t in enumerate(kinds))
        for i in reversed(range(len(kinds))):
            body = body.replace(f"${i}", f"%a{i}")
        entries.append(f".visible .entry {name}({params})\n{{\n{decl}\n{loads}\n{body}\nret;\n}}\n")
    return f".version 8.0\n.target {arch}\n.address_size 64\n" + "\n".join(entries)


def _asm(operands, asm: str, kinds: str):
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import llvm

    llvm.inline_asm(ir.Type.parse("!llvm.void"), list(operands), asm, ",".join(kinds) + ",~{memory}",
                    has_side_effects=True)


def _addr(ref, bits: int):
    """A shared (32-bit) or global (64-bit) address of a memref, for an asm operand."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import llvm
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    return llvm.ptrtoint(ir.IntegerType.get_signless(bits), mgpu_utils.memref_ptr(ref))


def _run(asm: str, spec: str, *args):
    """`asm` inline in a Mosaic GPU kernel of one warpgroup, its operands $0.. from `args` as `spec` says, one letter
    an operand: "S" a shared ref (its 32-bit address), "G" a global ref (its 64-bit generic address), "i" an int32
    scalar. The asm operand kinds follow ('l' for "G", else 'r')."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    scalar = plgpu.Layout.WG_SPLAT(())

    @plgpu.inline_mgpu(arg_types=tuple(scalar if c == "i" else plgpu.RefType() for c in spec))
    def run(_, *vals):
        operands = [v.registers.item() if c == "i" else _addr(v, 64 if c == "G" else 32) for c, v in zip(spec, vals)]
        _asm(operands, asm, "".join("l" if c == "G" else "r" for c in spec))

    run(*args)


_OUT_SPEC = {"global_pairs": "GG", "smem_pairs": "SS", "global_set": "G"}   # a select block's outputs ($4, $5)


def segment_select(u_smem, scratch_smem, n, pos, out0, out1=None, *, k: int, slots: int, aggregate: bool = False,
                   hist_ready: bool = False, pos_in: str = "implicit", out: str = "global_pairs", compact: bool = True,
                   threads: int = THREADS):
    """In a Mosaic GPU kernel of one warpgroup (threads 256: called by both warpgroups of the kernel, with the same
    arguments), after the segment's u keys are stored (`segment_select_ptx`):
    u_smem uint32/int32 [>= n] (shared), scratch_smem int32 [SCRATCH_WORDS] (shared), n (int32 scalar: entries to
    consider, a multiple of 4), pos (pos_in "implicit": an int32 scalar, the position of entry 0; "smem": a shared
    int32 [>= n] ref of positions), out0 / out1: the outputs for `out` (global refs for "global_pairs" /
    "global_set", shared refs for "smem_pairs"; no out1 for "global_set")."""
    asm = segment_select_ptx(k, slots, aggregate=aggregate, hist_ready=hist_ready, pos_in=pos_in, out=out,
                             compact=compact, threads=threads)
    outs = (out0,) if out == "global_set" else (out0, out1)
    _run(asm, "SSi" + ("i" if pos_in == "implicit" else "S") + _OUT_SPEC[out], u_smem, scratch_smem, n, pos, *outs)


def last_final(u_smem, scratch_smem, counters, keys_row, pos_row, set_row, row, *, n_split: int, slots: int,
               k: int):
    """`last_final_ptx` in a Mosaic GPU kernel of one warpgroup, right after this CTA's `segment_select` into the
    row's survivors (out "global_pairs"): u_smem int32 [>= 2 n_split slots] (the segment buffer, free again),
    scratch_smem int32 [SCRATCH_WORDS], counters the row counters (a GMEM semaphore array [rows], zero before the
    kernel: `pl.get_global`), keys_row / pos_row the row's survivors [n_split, slots] (global refs), set_row the
    row's set [k] (a global ref), row the int32 row index."""
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    n = n_split * slots
    _run(last_final_ptx(n_split, slots, k), "SSiSGGGGi", u_smem.at[pl.ds(0, n)], scratch_smem, jnp.int32(n),
         u_smem.at[pl.ds(n, n)], set_row, counters, keys_row, pos_row, row)


def prune_start(u_smem, scratch_smem, n_first: int, idx_smem, *, k: int, cap: int):
    """`prune_start_ptx` in a Mosaic GPU kernel of one warpgroup, after the block that completes the split's first
    n_first entries (its keys stored, counted into the first level, a warpgroup barrier)."""
    import jax.numpy as jnp

    _run(prune_start_ptx(k, cap), "SSiS", u_smem, scratch_smem, jnp.int32(n_first), idx_smem)


def prune_append(u_smem, scratch_smem, first, idx_smem, *, bt: int, cap: int):
    """`prune_append_ptx` in a Mosaic GPU kernel: the block of bt keys from entry `first` (int32 scalar), after its
    keys are stored and a warpgroup barrier."""
    _run(prune_append_ptx(bt, cap), "SSiS", u_smem, scratch_smem, first, idx_smem)


def prune_select(u_smem, scratch_smem, n, pos0, out0, out1, *, k: int, slots: int, idx_smem,
                 aggregate: bool = False, out: str = "global_pairs"):
    """`prune_final_ptx` in a Mosaic GPU kernel, after the split's last block: arguments as `segment_select`'s
    (n the split's entries, pos0 its first position, out "global_pairs" or "smem_pairs") and the candidate list."""
    _run(prune_final_ptx(k, slots, out=out, aggregate=aggregate), "SSiS" + _OUT_SPEC[out] + "i", u_smem,
         scratch_smem, n, idx_smem, out0, out1, pos0)


def hist_zero(scratch_smem, wg_local: bool = False):
    """`hist_zero_ptx` in a Mosaic GPU kernel (before the stream)."""
    _run(hist_zero_ptx(wg_local), "S", scratch_smem)


def hist_block(u_smem, scratch_smem, first, *, bt: int, aggregate: bool = False, wg_local: bool = False):
    """`hist_block_ptx` in a Mosaic GPU kernel: the block of bt keys from entry `first` (int32 scalar) into the
    first level's histogram (after the block's keys are stored and ordered before it: a warpgroup barrier, or the
    scoring warpgroup's mbarrier arrivals that this one waited for)."""
    _run(hist_block_ptx(bt, aggregate, wg_local), "SSi", u_smem, scratch_smem, first)


def cluster_sync():
    """barrier.cluster over every thread of the cluster's CTAs: releases this CTA's shared-memory writes to the
    cluster and acquires the others'."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    @plgpu.inline_mgpu()
    def run(_):
        from jax._src.lib.mlir import ir
        from jax._src.lib.mlir.dialects import llvm

        llvm.inline_asm(ir.Type.parse("!llvm.void"), [], "barrier.cluster.arrive.release;\n"
                        "barrier.cluster.wait.acquire;", "~{memory}", has_side_effects=True)

    run()


def gather(surv_u, surv_pos, dst_u, dst_pos, *, n_split: int, slots: int):
    """`gather_ptx` in a Mosaic GPU kernel (the cluster's CTA 0, between two `cluster_sync`s): every split CTA's
    survivors (shared refs at the same offsets in each CTA) into this CTA's dst_u / dst_pos [n_split * slots]."""
    _run(gather_ptx(n_split, slots), "SSSS", surv_u, surv_pos, dst_u, dst_pos)
