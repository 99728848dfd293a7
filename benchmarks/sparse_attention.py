"""Benchmark of the sparse window+compressed attention (Pallas GPU kernel vs the XLA reference) on V4-Flash shapes.

    PYTHONPATH=. python benchmarks/sparse_attention.py --out DIR [--quick] [--sweep] [--groups decode,prefill,b1,variants]

Per case: time per call (us), the memory floor (valid gathered KV rows read once + q read + o written, at the
measured copy bandwidth), ratio to the floor, achieved HBM GB/s (floor bytes / time), TFLOP/s (4*H*D per valid
entry per query), and the XLA reference timed in the same run. Timing: the op is called U times inside one jitted
function as a dependent chain (q_{k+1} = o_k), with R rotating index sets whose rows lie in R disjoint copies of the
pool, so the gathered rows of consecutive calls do not hit in L2; wall time of the whole jitted call (after warm-up,
median of 5) / U. Decode lists are fully valid (128 window rows + top-k / all HCA entries); prefill lists are fully
valid random rows of the sequence (causality does not change the kernel's work per valid entry).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import measure_ceilings, wall, wall_net
from pallas_kernels.sparse_attention import quantize_kv_fp8, sparse_attention
from pallas_kernels.sparse_attention.fp8_layout import ROW_BYTES

D = 512
H = 64
W = 128


def make_case(rng, kind, b, t, kc, csa_cap, fp8, n_copies, heads=H):
    """Pools with n_copies disjoint copies; index lists for each copy; q [b, t, heads, D]."""
    cap = csa_cap if kind == "csa" else kc  # compressed rows per sequence
    n_w = n_copies * b * W
    n_c = n_copies * b * cap
    key = jax.random.key(int(rng.integers(1 << 30)))
    k1, k2, k3, k4 = jax.random.split(key, 4)
    wpool = jax.random.normal(k1, (n_w, D), jnp.bfloat16)
    cpool = jax.random.normal(k2, (n_c, D), jnp.bfloat16)
    if fp8:
        wpool, cpool = quantize_kv_fp8(wpool), quantize_kv_fp8(cpool)
    q = jax.random.normal(k3, (b, t, heads, D), jnp.bfloat16)
    sinks = jax.random.normal(k4, (heads,), jnp.float32)
    widx, cidx = [], []
    for r in range(n_copies):
        if t == 1:
            wi = (np.arange(b)[:, None, None] * W + rng.permutation(W)[None, None, :]).astype(np.int32)
        else:  # prefill: per query its own random 128 window rows of the sequence
            wi = rng.integers(0, W, (b, t, W)).astype(np.int32) + (np.arange(b)[:, None, None] * W)
        if kind == "csa":
            if t == 1:
                ci = np.stack([rng.choice(cap, kc, replace=False) for _ in range(b)])[:, None, :]
            else:
                ci = rng.integers(0, cap, (b, t, kc))
        else:  # hca: dense over all entries
            ci = np.broadcast_to(np.arange(kc)[None, None, :], (b, t, kc))
        ci = (ci + np.arange(b)[:, None, None] * cap).astype(np.int32)
        widx.append(jnp.asarray(wi + r * b * W))
        cidx.append(jnp.asarray(ci + r * b * cap))
    return q, wpool, cpool, sinks, widx, cidx


def dispatcher_call(impl, opts):
    """The op as one jitted function (lowered once, chained U times): (q, wpool, widx, cpool, cidx, sinks) -> o."""
    return jax.jit(lambda q, wpool, widx, cpool, cidx, sinks: sparse_attention(
        q, wpool, widx, cpool, cidx, sinks, scale=D**-0.5, impl=impl, **opts))


def chained(fn, n, r):
    """n dependent calls of fn (q_{k+1} = o_k) over r rotating index sets, in one jitted program taking
    (q, wpool, cpool, sinks, widx, cidx)."""
    @jax.jit
    def run(q, wpool, cpool, sinks, widx, cidx):
        for i in range(n):
            q = fn(q, wpool, widx[i % r], cpool, cidx[i % r], sinks)
        return q
    return run


def time_impl(impl, q, wpool, cpool, sinks, widx, cidx, unroll, opts):
    one = dispatcher_call(impl, opts)
    first = one(q, wpool, widx[0], cpool, cidx[0], sinks)
    return wall(chained(one, unroll, len(widx)), q, wpool, cpool, sinks, widx, cidx, reps=5) / unroll, first


def per_call(fn, case, u1, u2):
    """Seconds per call of fn, chained (q_{k+1} = o_k) over the case's rotating index sets, net of dispatch:
    (wall of u2 chained calls - wall of u1) / (u2 - u1)."""
    r = len(case[4])
    return wall_net(lambda u: chained(fn, u, r), *case, n1=u1, n2=u2)[0]


def time_impl_net(impl, case, n, opts):
    """`per_call` of the dispatcher over chains of 1 and 1 + n calls. Prefill (session 10): `time_impl` divides one
    dispatch (100-250 us) by its 4 calls, a few % of a ~1.2 ms call."""
    return per_call(dispatcher_call(impl, opts), case, 1, 1 + n)


NET_DECODE = False   # --net-decode: decode rows also timed net of dispatch (chains of 1 and 1 + U calls)


def bench_case(rng, ceil, kind, b, t, kc, fp8, opts=None, ref=True, csa_cap=4096):
    opts = opts or {}
    row_b = ROW_BYTES if fp8 else 2 * D
    entries = b * t * (W + kc)
    kv_bytes = entries * row_b
    io_bytes = 2 * b * t * H * D * 2
    floor_bytes = kv_bytes + io_bytes
    flops = 4 * H * D * entries
    floor_s = max(floor_bytes / (ceil["copy_GBps"] * 1e9), flops / (ceil["bf16_TFLOPs"] * 1e12))
    n_copies = int(min(16, max(1, math.ceil(256e6 / kv_bytes))))
    est = floor_s * 2 + 6e-6
    unroll = int(min(128, max(4, math.ceil(3e-3 / est))))
    unroll = max(unroll, n_copies) if t == 1 else max(2, min(unroll, 16))
    case = make_case(rng, kind, b, t, kc, csa_cap, fp8, n_copies)
    res = dict(kind=kind, B=b, T=t, H=H, Kw=W, Kc=kc, kv="fp8" if fp8 else "bf16", opts=opts,
               floor_us=floor_s * 1e6, floor_MB=floor_bytes / 1e6, GFLOP=flops / 1e9, copies=n_copies, unroll=unroll)
    try:
        tp, o_p = time_impl("pallas", *case, unroll, opts)
        res.update(pallas_us=tp * 1e6, ratio_floor=tp / floor_s, GBps=floor_bytes / tp / 1e9, TFLOPs=flops / tp / 1e12)
        if t > 1 or NET_DECODE:   # prefill (and decode with --net-decode): also net of dispatch
            tn = time_impl_net("pallas", case, 4 if t > 1 else unroll, opts)
            res.update(pallas_net_us=tn * 1e6, TFLOPs_net=flops / tn / 1e12, ratio_floor_net=tn / floor_s)
    except Exception as e:  # report, keep going
        res["pallas_error"] = f"{type(e).__name__}: {str(e)[:400]}"
    if ref:
        try:
            u_ref = max(2, min(unroll, 8))
            tr, o_r = time_impl("reference", *case, u_ref, {})
            res.update(ref_us=tr * 1e6)
            if "pallas_us" in res:
                a, b_ = o_p.astype(jnp.float32), o_r.astype(jnp.float32)
                res["rel_err_vs_ref"] = float(jnp.linalg.norm(a - b_) / jnp.linalg.norm(b_))
            if "pallas_us" in res:
                res["speedup_vs_ref"] = tr / tp
        except Exception as e:
            res["ref_error"] = f"{type(e).__name__}: {str(e)[:400]}"
    del case
    return res


def fmt(r):
    if "pallas_us" not in r:
        return f"{r['kind']:5s} B={r['B']:<3d} T={r['T']:<5d} Kc={r['Kc']:<5d} {r['kv']:4s} ERROR {r.get('pallas_error', '')[:120]}"
    s = (f"{r['kind']:5s} B={r['B']:<3d} T={r['T']:<5d} Kc={r['Kc']:<5d} {r['kv']:4s} {r['pallas_us']:9.1f}us "
         f"floor {r['floor_us']:8.1f}us x{r['ratio_floor']:5.2f} {r['GBps']:6.0f}GB/s {r['TFLOPs']:6.1f}TF")
    if "pallas_net_us" in r:
        s += f" | net of dispatch {r['pallas_net_us']:9.1f}us x{r['ratio_floor_net']:5.2f} {r['TFLOPs_net']:6.1f}TF"
    if "ref_us" in r:
        s += f" | ref {r['ref_us']:9.1f}us x{r.get('speedup_vs_ref', 0):5.1f} err {r.get('rel_err_vs_ref', -1):.1e}"
    if r["opts"]:
        s += f" {r['opts']}"
    return s


# every --groups name main() knows (each an `if "<name>" in groups` block below)
GROUPS = (
    "b1", "colsplit", "decode", "fp8ops", "hca8k_fp8", "kernels", "knobs5", "prefetch", "prefill",
    "qreload", "s14", "s16", "s17", "s18", "s19", "s22", "s23", "s25", "s25d", "s26", "s26b", "s26c",
    "s28", "s29", "s29p", "s56", "s61", "s64", "s64f", "s64q", "s67", "s67a", "s67u", "s68", "s69", "s70", "s72", "s9", "ss", "variants")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="also sweep kernel configs on a few cases")
    ap.add_argument("--no-ref", action="store_true")
    ap.add_argument("--groups", default="decode,prefill,b1",
                    help="comma list: decode (B=16/64/128), prefill (S=4K/16K), b1 (decode at B=1), "
                         "hca8k_fp8 (the HCA-8K FP8 decode rows only), variants (kernel knobs on decode cases), "
                         "fp8ops / knobs5 / colsplit / prefetch / qreload (session 5-7 knob studies), kernels (Triton vs "
                         "Mosaic GPU on the bf16 cases, session 8), ss (Mosaic default vs split_scores, session 12), "
                         "s14 (the decode rows, session 14), s16 (store_wait / idx_first against the default, prefill "
                         "and decode), s17 (pingpong against the default), s19 (FP8: the Mosaic default against Triton), "
                         "s22 (FP8: the default against fp8_dequant='producer' / 'converter'), "
                         "s23 (FP8: fp8_dequant='consumers' against 'converter'), "
                         "s25 (FP8: 'consumers' against 'converter' alone and sharing the conversion with the "
                         "producer, conv_units from --conv-units), s25d (FP8: the diagonal chunk order in each conversion mode), s26 (FP8 default vs a three-tile ring, "
                         "tile_slots=3, with and without conv_units=5), s26b (FP8 default vs conv_batch 2 / 3 / 9, "
                         "and 3 with tile_slots=3), s26c (lazy_rescale on bf16 / FP8 decode and FP8 prefill), s28 (FP8 "
                         "prefill: pools dequantized first, fp8_pools='dequantize', vs in-kernel, bf16 alongside), "
                         "s29 (index rows streamed, idx_stream, vs whole lists: HCA decode and CSA decode), s29p (the same, "
                         "HCA prefill: 2048 queries x 8320 entries), s61 (score_ahead against the default, FP8 and "
                         "bf16, decode and bf16 prefill), s64 (consumers='asym' against the default pair, bf16 "
                         "decode and prefill, with and without lazy_rescale), s64q (its short form: CSA B=64 / 128, 16K prefill), s64f (FP8 decode: "
                         "the default, fp8_dequant='direct', and 'direct' with consumers='asym'), s67 (FP8: the "
                         "converter warpgroup's fp8_convert='rebias' vs 'cvt' vs _diag='bits', with conv_batch=3), "
                         "s67u (FP8 decode table rows and 16K prefill: the default against conv_units=7), s67a (FP8: "
                         "consumers='asym' over the converter's tiles against the pair), s68 (FP8 on asym, the "
                         "default since session 68: the producer taking 1 or 2 of the converter's 9 passes, "
                         "conv_units=8 / 7, at the shared register split and at (48, 48, 208), and the bound "
                         "without conversions, _diag='no_convert'), s69 (FP8 on asym: f16 tensor-core operands, "
                         "fp8_operands='f16', against bf16's, the no-conversion bound, f16 without q's conversion, "
                         "f16 with conv_batch=2 at (40, 72, 200), and fp8_chunk_order='owned' with f16 and bf16), s70 (FP8 on "
                         "asym: fp8_copy 'bulk', asym_scorer_cols=128 and asym_q_regs=256 against the defaults, with "
                         "bf16 operands and with f16 + owned), s72 (FP8 defaults: a third 32-row tile slot for a "
                         "staging slot, tile_slots=3 num_stages=2, at two register splits that give the converter 64, "
                         "and the defaults at one of them)")
    ap.add_argument("--dtypes", default="bf16,fp8", help="decode / prefill / b1 groups: the KV dtypes to run")
    ap.add_argument("--ref-batches", default=None,
                    help="decode / prefill / b1 groups: time the XLA reference only at these batch sizes (comma "
                         "list; prefill counts as batch 1; default: every row unless --no-ref)")
    ap.add_argument("--conv-units", default="4,5,6",
                    help="s25: comma list of the converter's share of a step's 9 conversion passes")
    ap.add_argument("--net-decode", action="store_true",
                    help="decode rows also net of dispatch: (wall of 1 + U chained calls - wall of 1) / U, next to "
                         "the chain's wall / U (which carries ~2-4 us of dispatch per call at U ~ 90, session 15)")
    args = ap.parse_args()
    global NET_DECODE
    NET_DECODE = args.net_decode
    groups = set(args.groups.split(","))
    unknown = sorted(groups - set(GROUPS))
    if unknown:   # a typo would otherwise run nothing and cost a device call
        ap.error(f"unknown --groups {unknown}; known: {', '.join(GROUPS)}")
    rng = np.random.default_rng(0)
    print("devices:", jax.devices(), "jax", jax.__version__, flush=True)
    ceil = measure_ceilings()
    print("ceilings:", ceil, flush=True)
    results = dict(ceilings=ceil, jax=jax.__version__, device=str(jax.devices()[0]), cmd=" ".join(sys.argv), rows=[])
    out_json = os.path.join(args.out, "sparse_attention_bench.json")

    def record(r):
        results["rows"].append(r)
        print(fmt(r), flush=True)
        with open(out_json, "w") as f:
            json.dump(results, f, indent=1)

    if args.sweep:
        sweep_cases = [("csa", 64, 1, 512, False), ("hca", 16, 1, 8192, True), ("csa", 1, 4096, 512, False)]
        sweep_opts = [
            dict(block_h=64, block_k=32, num_warps=8, num_stages=2),
            dict(block_h=64, block_k=64, num_warps=8, num_stages=2),
            dict(block_h=64, block_k=32, num_warps=4, num_stages=3),
            dict(block_h=32, block_k=64, num_warps=4, num_stages=2),
            dict(block_h=64, block_k=64, num_warps=8, num_stages=3, d_chunk=128),
        ]
        for kind, b, t, kc, fp8 in sweep_cases:
            for o in sweep_opts:
                if fp8 and "d_chunk" in o:
                    continue
                record(bench_case(rng, ceil, kind, b, t, kc, fp8, opts=o, ref=False))
            if t == 1:
                for ns in (1, 2, 4, 8):
                    record(bench_case(rng, ceil, kind, b, t, kc, fp8, opts=dict(n_splits=ns), ref=False))

    if "fp8ops" in groups:  # FP8 operand dtype x chunk width (session 5), decode B=64 and prefill 4K
        for kind, b, t, kc in [("csa", 64, 1, 512), ("hca", 16, 1, 8192), ("csa", 1, 4096, 512)]:
            for o in (dict(), dict(d_chunk=128), dict(fp8_operands="f16"), dict(fp8_operands="f16", d_chunk=128)):
                record(bench_case(rng, ceil, kind, b, t, kc, True, opts=o, ref=False,
                                  **(dict(csa_cap=t // 4) if t > 1 else {})))
    if "knobs5" in groups:  # session 5: wider warps / chunks / deeper pipelines on CSA decode B=64
        for fp8, opts in [(False, {}), (False, dict(num_warps=16)), (False, dict(d_chunk=256)),
                          (False, dict(block_k=32, num_stages=4)), (False, dict(block_k=128, num_stages=2)),
                          (True, {}), (True, dict(num_warps=16)), (True, dict(num_warps=16, fp8_operands="f16"))]:
            record(bench_case(rng, ceil, "csa", 64, 1, 512, fp8, opts=opts, ref=False))
    if "colsplit" in groups:  # session 6: output columns split over programs (smaller accumulator, q.K repeated)
        cs2, cs4 = dict(col_splits=2), dict(col_splits=4)
        for fp8 in (False, True):
            for b, o in [(64, {}), (64, cs2), (64, dict(col_splits=2, n_splits=1)), (64, cs4), (16, {}), (16, cs2),
                         (128, {}), (128, cs2)]:
                record(bench_case(rng, ceil, "csa", b, 1, 512, fp8, opts=o, ref=False))
            for o in ({}, cs2):
                record(bench_case(rng, ceil, "hca", 16, 1, 8192, fp8, opts=o, ref=False))
        for o in ({}, cs2):
            record(bench_case(rng, ceil, "csa", 1, 4096, 512, False, opts=o, ref=False, csa_cap=1024))
    if "prefetch" in groups:  # session 6 (not yet run): manual prefetch of the next block's index list / rows
        for kind, b, t, kc, fp8 in [("csa", 64, 1, 512, False), ("csa", 128, 1, 512, False), ("csa", 16, 1, 512, False),
                                    ("csa", 64, 1, 512, True), ("hca", 16, 1, 8192, False), ("csa", 1, 4096, 512, False)]:
            for o in ({}, dict(prefetch="idx"), dict(prefetch="rows"), dict(prefetch="rows", num_stages=3)):
                record(bench_case(rng, ceil, kind, b, t, kc, fp8, opts=o, ref=False,
                                  **(dict(csa_cap=t // 4) if t > 1 else {})))
    if "qreload" in groups:  # session 7: q reloaded per step instead of held in registers across the entry loop
        for kind, b, t, kc, fp8 in [("csa", 64, 1, 512, False), ("csa", 128, 1, 512, False), ("csa", 16, 1, 512, False),
                                    ("csa", 64, 1, 512, True), ("hca", 16, 1, 8192, False), ("csa", 1, 4096, 512, False),
                                    ("csa", 1, 4096, 512, True)]:
            for o in ({}, dict(q_reload=True), dict(q_reload=True, num_warps=4), dict(q_reload=True, block_k=32)):
                record(bench_case(rng, ceil, kind, b, t, kc, fp8, opts=o, ref=False,
                                  **(dict(csa_cap=t // 4) if t > 1 else {})))
    if "kernels" in groups:  # session 8: the two GPU kernels side by side on the bf16 cases (FP8: Triton only)
        for kind, b, t, kc in [("csa", 16, 1, 512), ("csa", 64, 1, 512), ("csa", 128, 1, 512), ("hca", 16, 1, 1024),
                               ("hca", 64, 1, 1024), ("hca", 16, 1, 8192), ("csa", 1, 4096, 512),
                               ("csa", 1, 16384, 512)]:
            for o in (dict(kernel="triton"), dict(kernel="mosaic")):
                record(bench_case(rng, ceil, kind, b, t, kc, False, opts=o, ref=False,
                                  **(dict(csa_cap=t // 4) if t > 1 else {})))
    if "ss" in groups:  # session 12: the Mosaic kernel's default vs split_scores (64 heads, bf16), each timed twice
        for kind, b, t, kc in [("csa", 16, 1, 512), ("csa", 64, 1, 512), ("csa", 128, 1, 512), ("hca", 16, 1, 1024),
                               ("hca", 64, 1, 1024), ("hca", 16, 1, 8192), ("csa", 1, 4096, 512),
                               ("csa", 1, 16384, 512)]:
            for o in (dict(kernel="mosaic", split_scores=False), dict(kernel="mosaic", split_scores=True)) * 2:
                record(bench_case(rng, ceil, kind, b, t, kc, False, opts=o, ref=False,
                                  **(dict(csa_cap=t // 4) if t > 1 else {})))
    if "s9" in groups:  # session 9: the rows of the issue table the decode group's CSA rows did not reach, with XLA
        for kind, b, t, kc in [("hca", 64, 1, 1024), ("hca", 64, 1, 8192), ("hca", 16, 1, 8192), ("csa", 1, 4096, 512)]:
            for fp8 in (False, True):
                record(bench_case(rng, ceil, kind, b, t, kc, fp8, ref=not args.no_ref,
                                  **(dict(csa_cap=t // 4) if t > 1 else {})))
    if "s14" in groups:  # session 14: the decode rows after the in-kernel index clean-up and the 2-kernel combine
        for kind, b, kc, fp8 in [("csa", 64, 512, False), ("csa", 128, 512, False), ("csa", 16, 512, False),
                                 ("hca", 16, 8192, False), ("hca", 64, 1024, False), ("csa", 64, 512, True)]:
            record(bench_case(rng, ceil, kind, b, 1, kc, fp8, ref=not args.no_ref))
    if "s16" in groups:  # session 16: the Mosaic kernel's store_wait="read" and idx_first against the default
        for kind, b, t, kc in [("csa", 1, 4096, 512), ("csa", 1, 16384, 512), ("csa", 64, 1, 512),
                               ("csa", 128, 1, 512)]:
            for o in ({}, dict(kernel="mosaic", store_wait="read"), dict(kernel="mosaic", idx_first=True),
                      dict(kernel="mosaic", store_wait="read", idx_first=True)):
                record(bench_case(rng, ceil, kind, b, t, kc, False, opts=o, ref=False,
                                  **(dict(csa_cap=t // 4) if t > 1 else {})))
    if "s17" in groups:  # session 17: the Mosaic kernel's pingpong (the consumers take turns at the tensor cores)
        for kind, b, t, kc in [("csa", 16, 1, 512), ("csa", 64, 1, 512), ("csa", 128, 1, 512), ("hca", 64, 1, 1024),
                               ("hca", 16, 1, 8192)]:
            for o in ({}, dict(kernel="mosaic", pingpong=True)):
                record(bench_case(rng, ceil, kind, b, t, kc, False, opts=o, ref=False))
        for t in (4096, 16384):   # prefill: split_scores (the default) against both consumers scoring, pingpong
            for o in ({}, dict(kernel="mosaic", split_scores=False),
                      dict(kernel="mosaic", split_scores=False, pingpong=True)):
                record(bench_case(rng, ceil, "csa", 1, t, 512, False, opts=o, ref=False, csa_cap=t // 4))
    if "s18" in groups:  # session 18: split_d (each consumer scores half of d; the pair's default) against off
        # ({} is today's default: consumers="asym" for bf16 since session 66, the pair with split_d before)
        for kind, b, kc in [("csa", 16, 512), ("csa", 64, 512), ("csa", 128, 512), ("hca", 16, 1024),
                            ("hca", 64, 1024), ("hca", 16, 8192)]:
            for o in ({}, dict(kernel="mosaic", split_d=False)):
                record(bench_case(rng, ceil, kind, b, 1, kc, False, opts=o, ref=False))
        for t in (4096, 16384):   # prefill: split_scores (the default there) against split_d
            for o in ({}, dict(kernel="mosaic", split_scores=False, split_d=True)):
                record(bench_case(rng, ceil, "csa", 1, t, 512, False, opts=o, ref=False, csa_cap=t // 4))
    if "s19" in groups:  # session 19: FP8 pools on the Mosaic kernel (split_d, one staging slot: the new default)
        for kind, b, kc in [("csa", 16, 512), ("csa", 64, 512), ("csa", 128, 512), ("hca", 64, 1024),
                            ("hca", 16, 8192)]:
            for o in ({}, dict(kernel="triton")):
                record(bench_case(rng, ceil, kind, b, 1, kc, True, opts=o, ref=False))
        for t in (4096, 16384):
            for o in ({}, dict(kernel="triton")):
                record(bench_case(rng, ceil, "csa", 1, t, 512, True, opts=o, ref=False, csa_cap=t // 4))
    if "s22" in groups:  # session 22: FP8 pools dequantized by the producer warpgroup (fp8_dequant="producer")
        pdq = dict(kernel="mosaic", fp8_dequant="producer")
        cvwg = dict(kernel="mosaic", fp8_dequant="converter")   # a fourth warpgroup converts (built in session 22)
        for kind, b, kc in [("csa", 16, 512), ("csa", 64, 512), ("csa", 128, 512), ("hca", 64, 1024),
                            ("hca", 16, 8192)]:
            for o in ({}, pdq, cvwg):
                record(bench_case(rng, ceil, kind, b, 1, kc, True, opts=o, ref=False))
        for t in (4096, 16384):
            for o in ({}, pdq, cvwg):
                record(bench_case(rng, ceil, "csa", 1, t, 512, True, opts=o, ref=False, csa_cap=t // 4))
    def fp8_modes(modes, decode_cases, prefill_lens=(16384,)):
        """FP8 pools, each kernel option set in `modes` on each decode case (kind, B, K_c) and CSA prefill length,
        without the XLA reference (the session knob studies below)."""
        for kind, b, kc in decode_cases:
            for o in modes:
                record(bench_case(rng, ceil, kind, b, 1, kc, True, opts=o, ref=False))
        for t in prefill_lens:
            for o in modes:
                record(bench_case(rng, ceil, "csa", 1, t, 512, True, opts=o, ref=False, csa_cap=t // 4))

    mos = dict(kernel="mosaic")
    cases4 = [("csa", 64, 512), ("csa", 128, 512), ("hca", 64, 8192), ("hca", 16, 8192)]
    if "s23" in groups:  # session 23: FP8 pools, the consumers dequantize (default) vs a converter warpgroup
        fp8_modes([dict(mos, fp8_dequant=m) for m in ("consumers", "converter")],
                  [("csa", 16, 512), ("csa", 64, 512), ("csa", 128, 512), ("hca", 64, 1024), ("hca", 16, 8192),
                   ("hca", 64, 8192)], (4096, 16384))
    if "s25" in groups:  # session 25: the converter warpgroup and the producer split each step's conversion
        fp8_modes([dict(mos, fp8_dequant=m) for m in ("consumers", "converter")]
                  + [dict(mos, fp8_dequant="converter", conv_units=int(u)) for u in args.conv_units.split(",") if u],
                  cases4[:3])
    if "s25d" in groups:  # session 25: FP8 conversion with the diagonal chunk order (no shared-memory conflicts)
        dg = dict(mos, fp8_chunk_order="diagonal")
        fp8_modes([mos, dg, dict(dg, fp8_dequant="converter"), dict(dg, fp8_dequant="converter", conv_units=5),
                   dict(dg, fp8_dequant="producer")], cases4)
    if "s26" in groups:  # built in session 25, to time next: a three-tile bf16 ring on the FP8 default
        cv = dict(mos, fp8_dequant="converter")
        fp8_modes([cv, dict(cv, tile_slots=3, num_stages=2), dict(cv, conv_units=5),
                   dict(cv, conv_units=5, tile_slots=3, num_stages=2)], cases4)
    if "s26b" in groups:  # session 26: a converting thread's chunks loaded in batches before their stores
        fp8_modes([dict(mos), *[dict(mos, conv_batch=n) for n in (2, 3, 9)],
                   dict(mos, conv_batch=3, tile_slots=3, num_stages=2)], cases4)
    if "s26c" in groups:  # session 26: the lazy rescale of the output accumulator, bf16 and FP8 pools
        for fp8 in (False, True):
            for kind, b, kc in [("csa", 64, 512), ("csa", 128, 512), ("hca", 64, 8192)]:
                for o in (dict(mos), dict(mos, lazy_rescale=True)):
                    record(bench_case(rng, ceil, kind, b, 1, kc, fp8, opts=o, ref=False))
        for o in (dict(mos), dict(mos, lazy_rescale=True), dict(mos, lazy_rescale=True, conv_batch=3)):
            record(bench_case(rng, ceil, "csa", 1, 16384, 512, True, opts=o, ref=False, csa_cap=4096))
    if "s28" in groups:  # session 28: FP8 prefill with the pools dequantized to bf16 first (fp8_pools) vs in-kernel
        # (S queries, compressed pool rows): the issue's prefill rows; a 16K chunk against a 1M-context pool (the
        # dequantization pass at its largest); few queries over a big pool (reuse 2.5 / 9.9: the auto rule's edge)
        for t, cap in ((4096, 1024), (16384, 4096), (16384, 262144), (256, 16384), (64, 16384)):
            if t >= 4096:   # bf16 pools of the same rows: the kernel the dequantized pools run on
                record(bench_case(rng, ceil, "csa", 1, t, 512, False, ref=False, csa_cap=cap))
            for mode in ("kernel", "dequantize"):
                record(bench_case(rng, ceil, "csa", 1, t, 512, True, opts=dict(fp8_pools=mode), ref=False,
                                  csa_cap=cap))
    if "s29" in groups:  # session 29: index rows streamed through a ring (idx_stream) vs whole lists in shared memory
        # the decode rows whose lists did not fit at the default split count (HCA-8K; HCA-1K at B=128), where the
        # default now streams: idx_stream=False is the split-further behaviour of sessions 18-28
        for fp8 in (False, True):
            for kind, b, kc in [("hca", 16, 8192), ("hca", 64, 8192), ("hca", 128, 8192), ("hca", 128, 1024)]:
                for o in (dict(mos), dict(mos, idx_stream=False)):
                    record(bench_case(rng, ceil, kind, b, 1, kc, fp8, opts=o, ref=False))
        for fp8 in (False, True):   # lists that fit: forced streaming against the default (which keeps them whole)
            for kind, b, kc in [("csa", 64, 512), ("csa", 128, 512)]:
                for o in (dict(mos), dict(mos, idx_stream=True)):
                    record(bench_case(rng, ceil, kind, b, 1, kc, fp8, opts=o, ref=False))
    if "s29p" in groups:  # session 29: HCA prefill (every query attends 128 + 8192 entries), streamed vs whole lists
        for o in (dict(mos), dict(mos, idx_stream=False)):
            record(bench_case(rng, ceil, "hca", 1, 2048, 8192, False, opts=o, ref=False))
    if "s56" in groups:  # session 56: the bf16 ring's barriers per piece of d (piece_barriers): off / rows / pieces
        for how in (False, "rows", "pieces"):
            o = dict(mos, piece_barriers=how)
            for kind, b, kc in [("csa", 64, 512), ("csa", 128, 512), ("hca", 64, 8192)]:
                record(bench_case(rng, ceil, kind, b, 1, kc, False, opts=o, ref=False))
            for t in (4096, 16384):
                record(bench_case(rng, ceil, "csa", 1, t, 512, False, opts=o, ref=False, csa_cap=t // 4))
    if "s61" in groups:  # session 61: the next step's score wgmma under this step's softmax (score_ahead)
        # FP8: the default (two tiles, three staging slots), its ring change alone (three tiles, two slots: what
        # score_ahead takes), score_ahead, and score_ahead with the producer sharing the conversion
        fp8_modes([dict(mos), dict(mos, tile_slots=3, num_stages=2), dict(mos, score_ahead=True),
                   dict(mos, score_ahead=True, conv_units=5)],
                  [("csa", 16, 512), ("csa", 64, 512), ("csa", 128, 512), ("hca", 64, 1024), ("hca", 64, 8192)], ())
        # bf16: the default (64-row steps, two slots), 32-row steps in four slots alone and with score_ahead, and
        # score_ahead on the default ring (both slots held: the producer waits), decode and prefill
        bk32 = dict(mos, block_k=32, num_stages=4)
        for o in (dict(mos), bk32, dict(bk32, score_ahead=True), dict(mos, score_ahead=True)):
            for kind, b, kc in [("csa", 64, 512), ("csa", 128, 512), ("hca", 64, 8192)]:
                record(bench_case(rng, ceil, kind, b, 1, kc, False, opts=o, ref=False))
            record(bench_case(rng, ceil, "csa", 1, 4096, 512, False, opts=o, ref=False, csa_cap=1024))
    if "s64" in groups or "s64q" in groups:  # session 64: FlashMLA's consumer split (consumers="asym") against the
        # default pair, bf16 decode (each row of the issue's table, B = 16 / 64 / 128) and prefill, and the lazy
        # rescale with it; s64q, the short form for a call with little device time left: CSA B = 64 / 128, 16K
        short = "s64" not in groups
        rows, lens = ([("csa", 64, 512), ("csa", 128, 512)], (16384,)) if short else (
            [("csa", 16, 512), ("csa", 64, 512), ("csa", 128, 512), ("hca", 64, 1024), ("hca", 16, 8192),
             ("hca", 64, 8192)], (4096, 16384))
        asym = dict(mos, consumers="asym")
        # (options, decode rows, prefill lengths); the pair named, so the comparison holds once asym is the default
        plan = [(dict(mos, consumers="pair"), rows, lens), (asym, rows, lens)]
        if not short:
            plan.append((dict(asym, lazy_rescale=True), [("csa", 128, 512)], (16384,)))
        for o, rows_, lens_ in plan:
            for kind, b, kc in rows_:
                record(bench_case(rng, ceil, kind, b, 1, kc, False, opts=o, ref=False))
            for t in lens_:
                record(bench_case(rng, ceil, "csa", 1, t, 512, False, opts=o, ref=False, csa_cap=t // 4))
    if "s64f" in groups:  # session 64, FP8: FlashMLA's shape (the direct gather + the asym split) against the
        # default (the converter warpgroup, the pair) and the direct gather with the pair, decode rows
        fp8_modes([dict(mos), dict(mos, fp8_dequant="direct"), dict(mos, fp8_dequant="direct", consumers="asym")],
                  [("csa", 64, 512), ("csa", 128, 512), ("hca", 64, 1024), ("hca", 64, 8192)], ())
    if "s67" in groups:  # session 67, FP8: the converter warpgroup's conversion, "rebias" (one e4m3x2 -> f16x2 a
        # pair, then integer and bf16 ops; its default in sessions 22-66) against four conversions a pair ("cvt",
        # the default since, as this group measured) and none at all (_diag="bits": bytes placed as bf16 bits),
        # rebias and bits also with conv_batch=3 (the options named, so the comparison holds across defaults)
        cv = dict(mos, fp8_dequant="converter")
        rb = dict(cv, fp8_convert="rebias")
        fp8_modes([rb, dict(cv, fp8_convert="cvt"), dict(rb, conv_batch=3), dict(cv, _diag="bits"),
                   dict(cv, _diag="bits", conv_batch=3)],
                  [("csa", 64, 512), ("csa", 128, 512), ("hca", 64, 1024), ("hca", 64, 8192)], (16384,))
    # the FP8 decode rows where the consumer split was timed (s67a, s68)
    asym_rows = [("csa", 16, 512), ("csa", 64, 512), ("csa", 128, 512), ("hca", 64, 1024), ("hca", 128, 1024),
                 ("hca", 64, 8192)]
    if "s67a" in groups:  # session 67, FP8: FlashMLA's consumer split over the converter warpgroup's 32-row tiles
        # (consumers="asym": one consumer scores over all of d and hands P to the other) against the default pair
        # (each consumer scores half of d, f32 partials exchanged), decode rows and 16K prefill in-kernel
        cv = dict(mos, fp8_dequant="converter")
        fp8_modes([dict(cv, consumers="pair"), dict(cv, consumers="asym")], asym_rows, (16384,))
    if "s68" in groups:  # session 68, FP8 on consumers="asym" (the default since): the converter warpgroup sets the
        # pace there (its span above the consumers', h100_s68r2), so the producer, idle ~28% of its span under asym,
        # takes one or two of the converter's nine passes a step (conv_units=8 / 7; slower under the pair, s67u),
        # at the shared split (56, 56, 200) and with the consumers' 208 registers kept (48, 48, 208); offline all
        # four compile without spills. Last, the bound: the converter storing the raw bytes (_diag="no_convert",
        # wrong output), what asym's FP8 decode would take if converting cost nothing but its loads and stores.
        # Every option named, so the comparison holds across defaults
        asym = dict(mos, fp8_dequant="converter", consumers="asym")
        fp8_modes([asym] + [dict(asym, conv_units=u, **r) for u in (8, 7) for r in ({}, dict(regs=(48, 48, 208)))]
                  + [dict(asym, _diag="no_convert")], asym_rows, (16384,))
    if "s69" in groups:  # session 69, FP8 on asym over the converter's tiles: f16 tensor-core operands
        # (fp8_operands="f16": one conversion instruction a pair instead of four, q converted in the kernel, P in
        # f16) against bf16's (the default), next to the bound without conversions (_diag="no_convert", wrong
        # output), f16 without q's conversion (_diag="no_q_convert", wrong output: what converting q costs) and f16
        # with the conversion unrolled in batches of two (conv_batch=2: no 64-bit loop index math; (40, 72, 200)
        # registers keep it from spilling), then the "owned" chunk order (a converting thread owns a row: static
        # offsets, no index arithmetic) with f16 and bf16 operands. Every option named, so the comparison holds
        # across defaults
        asym = dict(mos, fp8_dequant="converter", consumers="asym")
        f16 = dict(asym, fp8_operands="f16")
        fp8_modes([dict(asym, fp8_operands="bf16"), f16, dict(asym, _diag="no_convert"),
                   dict(f16, _diag="no_q_convert"), dict(f16, conv_batch=2, regs=(40, 72, 200)),
                   dict(f16, fp8_chunk_order="owned"), dict(asym, fp8_operands="bf16", fp8_chunk_order="owned")],
                  [r for r in asym_rows if r != ("hca", 64, 1024)], (16384,))
    if "s70" in groups:  # session 70, FP8 on asym over the converter's tiles: how the producer issues a staged row
        # (fp8_copy: three 2-D tensor copies by lane 0, the default "tma"; two 1-D bulk copies, "bulk"), a
        # quarter of P.V moved from the scorer
        # to the helper (asym_scorer_cols=128) and q's first 256 columns in the scorer's registers (asym_q_regs,
        # no shared-memory reads for them), with bf16 operands (the default) and with f16 + the owned chunk
        # order (session 69's pair). Every option named, so the comparison holds across defaults; the decode rows,
        # then 16K prefill in-kernel for the default and the two combinations
        asym = dict(mos, fp8_dequant="converter", consumers="asym", fp8_operands="bf16", fp8_chunk_order="diagonal",
                    fp8_copy="tma", asym_scorer_cols=256, asym_q_regs=0)
        f16o = dict(asym, fp8_operands="f16", fp8_chunk_order="owned")
        sc = dict(asym_scorer_cols=128, asym_q_regs=0)
        scq = dict(asym_scorer_cols=128, asym_q_regs=256)
        alls = dict(scq, fp8_copy="bulk")
        fp8_modes([asym, dict(asym, fp8_copy="bulk"), dict(asym, **sc), dict(asym, **scq), dict(asym, **alls), f16o,
                   dict(f16o, **alls)],
                  [("csa", 128, 512), ("csa", 64, 512), ("hca", 64, 8192)], ())
        fp8_modes([asym, dict(asym, **alls), dict(f16o, **alls)], [("hca", 128, 1024), ("csa", 16, 512)], (16384,))
    if "s72" in groups:  # session 72, FP8 on session 71's defaults: the producer, the converter and the scorer take
        # about the same time a 32-row step (h100_s71r1_mprof), and with two tile slots the converter can be only one
        # tile ahead of the consumers. A third tile slot (32 KB) fits for one staging slot (tile_slots=3,
        # num_stages=2: 219752 B); at the default registers its converter spills 20 B (offline), at (40, 64, 184,
        # 224) and (32, 64, 184, 232) nothing. The defaults at (40, 64, 184, 224) as the control for the register
        # move alone. Every row's variants back to back; the first entry is today's default kernel, with
        # fp8_pools="kernel" so that the prefill row runs the in-kernel converter like the others (without it the
        # op dequantizes a prefill's pools first, as session 73's first run of this group did)
        t3 = dict(mos, tile_slots=3, num_stages=2)
        fp8_modes([dict(mos, fp8_pools="kernel"), dict(t3, regs=(40, 64, 184, 224)), dict(t3, regs=(32, 64, 184, 232)),
                   dict(mos, regs=(40, 64, 184, 224))],
                  [("csa", 128, 512), ("csa", 64, 512), ("hca", 64, 8192), ("hca", 128, 1024)], (16384,))
    if "s67u" in groups:  # session 67, FP8: the producer taking 2 of the converter's 9 passes a step (conv_units=7,
        # 1-2% faster in one call of s25) against the default, every row of the issue's FP8 decode table, each row's
        # two runs back to back
        rows = [(k, b, kc) for k, kc in (("csa", 512), ("hca", 1024), ("hca", 8192)) for b in (16, 64, 128)]
        fp8_modes([dict(mos), dict(mos, fp8_dequant="converter", conv_units=7)], rows, (16384,))
    if "variants" in groups:  # kernel knobs on the decode cases furthest from their floor
        for kind, b, kc, fp8 in [("csa", 16, 512, False), ("csa", 64, 512, True), ("hca", 16, 8192, True)]:
            for o in ({}, dict(partial_dtype="bfloat16"), dict(fp8_scales="vector"),
                      dict(fp8_scales="vector", partial_dtype="bfloat16")):
                if "fp8_scales" in o and not fp8:
                    continue
                record(bench_case(rng, ceil, kind, b, 1, kc, fp8, opts=o, ref=False))
    batches = [16, 64, 128] if not args.quick else [16, 64]
    decode = [("csa", 512), ("hca", 1024), ("hca", 8192)]
    kv_fp8 = [{"bf16": False, "fp8": True}[x] for x in args.dtypes.split(",") if x]
    ref_b = None if args.ref_batches is None else {int(x) for x in args.ref_batches.split(",") if x}

    def ref_at(b):
        return not args.no_ref and (ref_b is None or b in ref_b)

    if "decode" in groups:
        for kind, kc in decode:
            for b in batches:
                for fp8 in kv_fp8:
                    record(bench_case(rng, ceil, kind, b, 1, kc, fp8, ref=ref_at(b)))
    elif "hca8k_fp8" in groups:
        for b in batches:
            record(bench_case(rng, ceil, "hca", b, 1, 8192, True, ref=ref_at(b)))
    if "prefill" in groups:
        for s_len in (4096, 16384):
            for fp8 in kv_fp8:
                record(bench_case(rng, ceil, "csa", 1, s_len, 512, fp8, ref=ref_at(1), csa_cap=s_len // 4))
    if "b1" in groups:
        for kind, kc in decode:
            for fp8 in kv_fp8:
                record(bench_case(rng, ceil, kind, 1, 1, kc, fp8, ref=ref_at(1)))
    print("\n==== summary (pallas time, floor, ratio, GB/s, TFLOP/s | XLA reference) ====")
    print("ceilings:", {k: round(v, 1) for k, v in ceil.items()})
    for r in results["rows"]:
        print(fmt(r))


if __name__ == "__main__":
    main()
