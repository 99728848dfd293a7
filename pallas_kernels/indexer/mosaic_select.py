"""A segment's top-k superset selected inside the Mosaic indexer scores kernel (`gpu_mosaic.py`, `select_k`): the
tournament's first stage (`topk_hist.tournament_stage`) moved into the CTA that computed the scores.

    segment_select(seg_smem, scratch_smem, n, pos0, keys_out, pos_out, *, k, slots)   (inside the kernel)
    segment_select_model(scores [n] f32, pos0, k, slots) -> (keys [slots] i32, pos [slots] i32)   (numpy, same rule)

Why: at B = 64 x 128K context (fp8 keys) the scores kernel streams the keys in ~89 us and the tournament top-k runs
after it as two more Triton kernels (~20 us for 512 segment programs, ~9 us for the final one per row, session 36),
so the call ends at ~1.7x its byte floor. Every scores CTA already holds one split of a row (8192 keys at the
default 4 splits); here it keeps that split's scores in shared memory (32 KB), and after its last block selects
their top-k superset and writes only that (k + slack (key, position) pairs) instead of the 8192 scores. The final
per-row selection (`topk_hist.hist_select` with a position map) then reads 4 x 576 survivors a row instead of 32768
scores. The selection runs in the last ~2-3 us of each CTA, on data in shared memory.

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

Exactness is the numpy model's (`segment_select_model`, checked against `lax.top_k` sets on the CPU); the PTX is
checked by ptxas on the CPU where ptxas is found, and against the model and the reference on the H200.
"""

from __future__ import annotations

import numpy as np

LEVELS = ((21, 11), (10, 11), (0, 10))     # (shift, width) of each radix digit of u, from the top
BINS = 1 << max(w for _, w in LEVELS)     # histogram counters (u32) in the scratch
SCRATCH_WORDS = BINS + 32                  # + the exchange words: [BINS, +4) warp totals, +8.. the bin found,
#                                            +16.. / +20.. the quarters' counts
NEG_INF_KEY = -2139095041                  # topk._ordered_i32(-inf)
INT32_MIN = -(2 ** 31)
THREADS = 128


def _ordered(scores):
    bits = np.asarray(scores, np.float32).view(np.int32)
    return bits ^ ((bits >> 31) & np.int32(0x7FFFFFFF))


def segment_select_model(scores, pos0: int, k: int, slots: int):
    """numpy model of the kernel's rule (module doc): scores [n] float32 -> (keys [slots] int32, pos [slots] int32),
    the kept entries in ascending position, (INT32_MIN, 0) padding after."""
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
    pos[:len(idx)] = pos0 + idx
    return keys, pos


def segment_select_ptx(k: int, slots: int, aggregate: bool = False) -> str:
    """The selection as one PTX block for 128 threads. Operands: $0 scores (shared u32 address, f32 [>= n], 16 B
    aligned), $1 scratch (shared u32 address, u32 [SCRATCH_WORDS], 16 B aligned), $2 n (entries, a multiple of 4),
    $3 pos0, $4 / $5 the CTA's keys / positions output (generic 64-bit pointers to int32 [slots]).
    aggregate: the histogram's lanes that hit one bin add once (`match.any` groups them, the lowest lane adds the
    group's size): fewer conflicting shared-memory atomics where the scores crowd into a few bins."""
    if not 1 <= k <= slots:
        raise ValueError(f"segment_select: need 1 <= k ({k}) <= slots ({slots})")
    if slots >= 1 << 24:
        raise ValueError(f"segment_select: slots {slots} too large")
    X = 4 * BINS                                               # byte offset of the exchange words
    L = []
    a = L.append
    a("{")
    a(".reg .pred p, q, own, fnd, v0, v1, v2, v3, g0, g1, g2, g3, e0, e1, e2, e3, k0, k1, k2, k3;")
    a(".reg .b32 tid, lane, warp, need, cgt, P, sh, i, j, t, t2, x, y, st, exc, acc, bst, abv, inb, ha, base, tot;")
    a(".reg .b32 f0, f1, f2, f3, key0, key1, key2, key3, u0, u1, u2, u3, hi, bin, ad, lt, c, start;")
    a(".reg .b32 w0, w1, w2, w3, gc, ec, G, quota, ko, es, ktot, ek0, ek1, ek2, ek3, eo, r, m0, m1, m2, m3;")
    a(".reg .b32 b0, b1, b2, b3, n0, n1, n2, n3, rank, slot, rank0, slot0, pos;")
    a(".reg .b32 cnt<16>, kb, mm, wb;")
    a(".reg .b64 ka, pa, a64;")
    a("mov.u32 tid, %tid.x;")
    a("and.b32 lane, tid, 31;")
    a("shr.u32 warp, tid, 5;")
    a("mov.u32 lt, %lanemask_lt;")
    a("cvta.to.global.u64 ka, $4;")
    a("cvta.to.global.u64 pa, $5;")
    a(f"mov.u32 need, {k};")
    a("mov.u32 cgt, 0;")
    a("mov.u32 P, 0;")
    a("bar.sync 1, 128;")                                      # every score is in shared memory

    def key_of(f, key, u, v):   # ordered int32 key, its validity, and u = key ^ 2^31
        a(f"shr.s32 t, {f}, 31;")
        a("and.b32 t, t, 0x7FFFFFFF;")
        a(f"xor.b32 {key}, {f}, t;")
        a(f"setp.gt.s32 {v}, {key}, {NEG_INF_KEY};")
        a(f"xor.b32 {u}, {key}, 0x80000000;")

    for lvl, (s, w) in enumerate(LEVELS):
        nb, per = 1 << w, (1 << w) // THREADS
        a(f"// level {lvl}: digit u[{s + w - 1}:{s}]")
        a("mad.lo.u32 ha, tid, 4, $1;")
        for m in range(per):
            a(f"st.shared.u32 [ha+{512 * m}], 0;")
        a("bar.sync 1, 128;")
        # thread tid: entries 4 tid + 512 m .. + 3; the loop runs while the warp's first entry wb is below n (the
        # same trip count for every lane of a warp, as match.any needs), entries past n load as -inf
        a("shl.b32 i, tid, 2;")
        a("shl.b32 wb, warp, 7;")
        a(f"DSV4SEL_CNT{lvl}:")
        a("setp.ge.u32 p, wb, $2;")
        a(f"@p bra DSV4SEL_CNTEND{lvl};")
        a("mov.b32 f0, 0xFF800000; mov.b32 f1, 0xFF800000; mov.b32 f2, 0xFF800000; mov.b32 f3, 0xFF800000;")
        a("setp.lt.u32 p, i, $2;")
        a("mad.lo.u32 ad, i, 4, $0;")
        a("@p ld.shared.v4.b32 {f0, f1, f2, f3}, [ad];")
        for e in range(4):
            key_of(f"f{e}", f"key{e}", f"u{e}", "q")
            if s + w < 32:
                a(f"shr.b32 hi, u{e}, {s + w};")
                a("setp.eq.and.u32 q, hi, P, q;")
            a(f"shr.b32 bin, u{e}, {s};" if s else f"mov.b32 bin, u{e};")
            a(f"and.b32 bin, bin, {nb - 1};")
            a("mad.lo.u32 ad, bin, 4, $1;")
            if aggregate:   # lanes of one bin: the lowest adds the group's size (invalid lanes share key ~0)
                a("selp.b32 kb, bin, 0xFFFFFFFF, q;")
                a("match.any.sync.b32 mm, kb, 0xffffffff;")
                a("and.b32 t, mm, lt;")
                a("setp.eq.and.u32 q, t, 0, q;")
                a("popc.b32 t, mm;")
                a("@q red.shared.add.u32 [ad], t;")
            else:
                a("@q red.shared.add.u32 [ad], 1;")
        a("add.u32 i, i, 512;")
        a("add.u32 wb, wb, 512;")
        a(f"bra DSV4SEL_CNT{lvl};")
        a(f"DSV4SEL_CNTEND{lvl}:")
        a("bar.sync 1, 128;")
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
        a("bar.sync 1, 128;")
        a(f"ld.shared.v4.u32 {{w0, w1, w2, w3}}, [$1+{X}];")
        a("add.u32 tot, w0, w1; add.u32 tot, tot, w2; add.u32 tot, tot, w3;")
        a("mov.u32 exc, 0;")                                   # entries in the warps above this one
        a("setp.lt.u32 p, warp, 3; @p add.u32 exc, exc, w3;")
        a("setp.lt.u32 p, warp, 2; @p add.u32 exc, exc, w2;")
        a("setp.lt.u32 p, warp, 1; @p add.u32 exc, exc, w1;")
        a("add.u32 exc, exc, x; sub.u32 exc, exc, st;")        # ... + in this warp's threads above this one
        a("add.u32 t, exc, st;")
        a("setp.lt.u32 own, exc, need;")
        a("setp.ge.and.u32 own, t, need, own;")                 # the need-th largest is in this thread's bins
        a("mov.u32 acc, exc; mov.u32 bst, 0; mov.u32 abv, 0; mov.u32 inb, 0;")
        a("setp.ne.u32 fnd, tid, tid;")                           # false
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
        a("bar.sync 1, 128;")
        a(f"ld.shared.v4.u32 {{bst, abv, inb, t2}}, [$1+{X + 32}];")
        a(f"shl.b32 P, P, {w};")
        a("or.b32 P, P, bst;")
        a("add.u32 cgt, cgt, abv;")
        a("sub.u32 need, need, abv;")
        a(f"mov.u32 sh, {s};")
        if lvl < len(LEVELS) - 1:
            a("add.u32 t, cgt, inb;")
            a(f"setp.le.u32 p, t, {slots};")
            a("@p bra DSV4SEL_COMPACT;")
    # ordered compaction: warp wq takes the quarter [wq * c, wq * c + c), c = 128 * ceil(n / 512)
    a("DSV4SEL_COMPACT:")
    a("add.u32 c, $2, 511; shr.u32 c, c, 9; shl.b32 c, c, 7;")
    a("mul.lo.u32 start, warp, c;")

    def load4():   # entries i..i+3 (i = start + j + 4 lane); past n: -inf (invalid)
        a("add.u32 i, start, j;")
        a("shl.b32 t, lane, 2; add.u32 i, i, t;")
        a("mov.b32 f0, 0xFF800000; mov.b32 f1, 0xFF800000; mov.b32 f2, 0xFF800000; mov.b32 f3, 0xFF800000;")
        a("setp.lt.u32 p, i, $2;")
        a("mad.lo.u32 ad, i, 4, $0;")
        a("@p ld.shared.v4.b32 {f0, f1, f2, f3}, [ad];")
        for e in range(4):
            key_of(f"f{e}", f"key{e}", f"u{e}", f"v{e}")
            a(f"shr.b32 hi, u{e}, sh;")
            a(f"setp.gt.and.u32 g{e}, hi, P, v{e};")
            a(f"setp.eq.and.u32 e{e}, hi, P, v{e};")

    def lanes_below(pred, mask, acc):   # mask{e} = the warp's ballot of pred{e}; acc += its set lanes below this one
        a(f"mov.u32 {acc}, {acc}0;")
        for e in range(4):
            a(f"vote.sync.ballot.b32 {mask}{e}, {pred}{e}, 0xffffffff;")
            a(f"and.b32 t, {mask}{e}, lt; popc.b32 t, t; add.u32 {acc}, {acc}, t;")

    def store(index, base, value, pred=None):   # int32 base[index] = value (64-bit global address)
        a(f"mul.wide.u32 a64, {index}, 4;")
        a(f"add.u64 a64, {base}, a64;")
        a(f"{'@' + pred + ' ' if pred else ''}st.global.b32 [a64], {value};")

    a("mov.u32 gc, 0; mov.u32 ec, 0; mov.u32 j, 0;")
    a("DSV4SEL_CA:")
    a("setp.ge.u32 p, j, c;")
    a("@p bra DSV4SEL_CAEND;")
    load4()
    for e in range(4):
        a(f"vote.sync.ballot.b32 t, g{e}, 0xffffffff; popc.b32 t, t; add.u32 gc, gc, t;")
        a(f"vote.sync.ballot.b32 t, e{e}, 0xffffffff; popc.b32 t, t; add.u32 ec, ec, t;")
    a("add.u32 j, j, 128;")
    a("bra DSV4SEL_CA;")
    a("DSV4SEL_CAEND:")
    a("setp.eq.u32 p, lane, 0;")
    a("mad.lo.u32 ad, warp, 4, $1;")
    a(f"@p st.shared.u32 [ad+{X + 64}], gc;")
    a(f"@p st.shared.u32 [ad+{X + 80}], ec;")
    a("bar.sync 1, 128;")
    a(f"ld.shared.v4.u32 {{w0, w1, w2, w3}}, [$1+{X + 64}];")   # entries above P, per quarter
    a(f"ld.shared.v4.u32 {{n0, n1, n2, n3}}, [$1+{X + 80}];")   # entries at P, per quarter
    a("add.u32 G, w0, w1; add.u32 G, G, w2; add.u32 G, G, w3;")
    a(f"mov.u32 quota, {slots}; sub.u32 quota, quota, G;")      # entries at P that fit, in position order
    # quarter q keeps min(max(quota - (entries at P in quarters before q), 0), n_q) of its entries at P
    a("mov.u32 eo, 0;")
    for qq in range(4):
        a(f"sub.s32 r, quota, eo; max.s32 r, r, 0; min.s32 ek{qq}, r, n{qq}; add.u32 eo, eo, n{qq};")
    a("mov.u32 ko, 0; mov.u32 es, 0;")                          # this quarter's output offset and P-rank offset
    for qq in range(3):
        a(f"setp.gt.u32 p, warp, {qq};")
        a(f"@p add.u32 ko, ko, w{qq}; @p add.u32 ko, ko, ek{qq}; @p add.u32 es, es, n{qq};")
    a("add.u32 ktot, G, ek0; add.u32 ktot, ktot, ek1; add.u32 ktot, ktot, ek2; add.u32 ktot, ktot, ek3;")
    a("mov.u32 j, 0;")
    a("DSV4SEL_CB:")
    a("setp.ge.u32 p, j, c;")
    a("@p bra DSV4SEL_CBEND;")
    load4()

    # rank of (lane, e) among the chunk's entries at P: lanes below (all 4 of each) + this lane's e' < e
    a("mov.u32 rank0, es;")
    lanes_below("e", "m", "rank")
    for e in range(4):
        a(f"setp.lt.u32 q, rank, quota;")
        a(f"and.pred q, q, e{e};")
        a(f"or.pred k{e}, g{e}, q;")
        a(f"selp.u32 t, 1, 0, e{e}; add.u32 rank, rank, t;")
    a("mov.u32 slot0, ko;")
    lanes_below("k", "b", "slot")
    for e in range(4):
        a(f"add.u32 pos, $3, i; add.u32 pos, pos, {e};")
        store("slot", "ka", f"key{e}", f"k{e}")
        store("slot", "pa", "pos", f"k{e}")
        a(f"selp.u32 t, 1, 0, k{e}; add.u32 slot, slot, t;")
    for e in range(4):
        a(f"popc.b32 t, b{e}; add.u32 ko, ko, t;")
        a(f"popc.b32 t, m{e}; add.u32 es, es, t;")
    a("add.u32 j, j, 128;")
    a("bra DSV4SEL_CB;")
    a("DSV4SEL_CBEND:")
    # padding past the kept entries
    a("add.u32 i, ktot, tid;")
    a("DSV4SEL_PAD:")
    a(f"setp.ge.u32 p, i, {slots};")
    a("@p bra DSV4SEL_PADEND;")
    store("i", "ka", INT32_MIN)
    store("i", "pa", 0)
    a(f"add.u32 i, i, {THREADS};")
    a("bra DSV4SEL_PAD;")
    a("DSV4SEL_PADEND:")
    a("}")
    return "\n".join(L)


def standalone_ptx(k: int, slots: int, arch: str = "sm_90a", aggregate: bool = False) -> str:
    """A PTX module with one kernel wrapping `segment_select_ptx` (its operands from kernel parameters), for
    assembling with ptxas on a machine without a GPU (tests) or launching directly."""
    body = segment_select_ptx(k, slots, aggregate)
    for idx, name in enumerate(("%sc", "%sx", "%n", "%p0", "%ko", "%po")):
        body = body.replace(f"${idx}", name)
    return f""".version 8.0
.target {arch}
.address_size 64
.visible .entry segment_select_probe(.param .u32 sc_param, .param .u32 sx_param, .param .u32 n_param,
    .param .u32 p0_param, .param .u64 ko_param, .param .u64 po_param)
{{
.reg .b32 %sc, %sx, %n, %p0;
.reg .b64 %ko, %po;
ld.param.u32 %sc, [sc_param];
ld.param.u32 %sx, [sx_param];
ld.param.u32 %n, [n_param];
ld.param.u32 %p0, [p0_param];
ld.param.u64 %ko, [ko_param];
ld.param.u64 %po, [po_param];
{body}
ret;
}}
"""


def segment_select(seg_smem, scratch_smem, n, pos0, keys_out, pos_out, *, k: int, slots: int,
                   aggregate: bool = False):
    """In a Mosaic GPU kernel of one warpgroup, after the segment's scores are stored: seg_smem f32 [>= n] (shared),
    scratch_smem int32 [SCRATCH_WORDS] (shared), n (int32 scalar: entries to consider, a multiple of 4), pos0 (int32
    scalar: position of entry 0), keys_out / pos_out int32 [slots] refs in global memory (this CTA's output rows).
    Writes the segment's top-k superset (module doc)."""
    import jax.numpy as jnp  # noqa: F401  (the decorator's types)
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import llvm
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    from jax.experimental.pallas import mosaic_gpu as plgpu

    asm = segment_select_ptx(k, slots, aggregate)
    scalar = plgpu.Layout.WG_SPLAT(())

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), scalar, scalar, plgpu.RefType(),
                                  plgpu.RefType()))
    def run(_, seg, scratch, n_, pos0_, kout, pout):
        i32 = ir.IntegerType.get_signless(32)
        i64 = ir.IntegerType.get_signless(64)
        smem_addr = lambda ref: llvm.ptrtoint(i32, mgpu_utils.memref_ptr(ref))
        gmem_addr = lambda ref: llvm.ptrtoint(i64, mgpu_utils.memref_ptr(ref))
        scalar_of = lambda x: x.registers.item()
        llvm.inline_asm(ir.Type.parse("!llvm.void"),
                        [smem_addr(seg), smem_addr(scratch), scalar_of(n_), scalar_of(pos0_), gmem_addr(kout),
                         gmem_addr(pout)],
                        asm, "r,r,r,r,l,l,~{memory}", has_side_effects=True)

    run(seg_smem, scratch_smem, n, pos0, keys_out, pos_out)
