"""Where does the Mosaic attention kernel's time go? Each warpgroup's phases, from Mosaic GPU's on-device profiler.

Decode sits at 2-3x its memory floor (CSA B=64 / 128) and neither the gather bandwidth (the producer alone moves
3.4-3.9 TB/s, session 8) nor the consumers' MMA (split_scores cut a third of it and changed nothing, session 12)
explains it by measurement. This runs the kernel with `_profile` (gpu_mosaic.py): thread 0 of each warpgroup
stamps the SM clock at the entry and exit of named regions,

  producer   p_setup (q, sinks, index rows until landed), per step p_wait_empty (slot free) and p_issue
  consumers  c_wait_q, per step c_wait_full (the block landed), c_scores (q K^T wgmma), c_softmax, c_pv (P.V
             wgmma; c_split_softmax with split_scores, c_dequant with FP8 pools, c_dequant_scores with
             fp8_overlap: the conversions and the score wgmma interleaved), then c_epilogue. With
             piece_barriers (the pair's bf16 decode default since session 56) the waits for the block's pieces
             sit inside c_scores, and c_wait_full is empty: pass piece_barriers=False to see them apart. Since
             session 66 a bf16 case that names none of the pair's modes profiles consumers="asym" (the default)

and prints, per role and region, cycles per occurrence and per CTA, the share of the CTA's span, and how the CTAs'
start times spread over the launch (waves). Reading: if c_wait_full dominates the consumers, the gathers bind
(latency: too few slots in flight); if p_wait_empty dominates the producer, the consumers do; a large p_setup /
c_wait_q or c_epilogue next to few steps per CTA is the fixed per-CTA cost.

    PYTHONPATH=. python benchmarks/mosaic_phase_profile.py --out DIR [--cases csa64,csa128,...] [--clock-ghz 1.98]

The raw traces (Chrome / Perfetto JSON, one track per warpgroup) stay under --dump (default /tmp/...).

Needs a Hopper GPU. `summarize` (the trace reader) is tested on the CPU with a synthetic trace.
"""

from __future__ import annotations

import argparse
import glob
import inspect
import json
import os
import sys
import time
from collections import defaultdict

import numpy as np

WARPGROUPS = 3          # the kernel's block: consumers 0 and 1, producer 2 (and converter 3 with fp8_dequant="converter")
ROLE = {0: "consumer", 1: "consumer", 2: "producer", 3: "converter"}

# name -> (kind, B, T, K_c, kv, options)
CASES = {
    "csa16": ("csa", 16, 1, 512, "bf16", {}),
    "csa64": ("csa", 64, 1, 512, "bf16", {}),
    "csa128": ("csa", 128, 1, 512, "bf16", {}),
    "csa64_ns1": ("csa", 64, 1, 512, "bf16", dict(n_splits=1)),
    "hca1k64": ("hca", 64, 1, 1024, "bf16", {}),
    "hca8k16": ("hca", 16, 1, 8192, "bf16", {}),
    "csa64_fp8": ("csa", 64, 1, 512, "fp8", {}),        # FP8 default (session 19): split_d, one slot, half-d dequant
    "csa128_fp8": ("csa", 128, 1, 512, "fp8", {}),
    "csa64_fp8_both": ("csa", 64, 1, 512, "fp8", dict(split_d=True, num_stages=1, _diag="dequant_both")),
    "csa64_fp8_nosd": ("csa", 64, 1, 512, "fp8", dict(num_stages=2)),      # the FP8 structure before session 19
    "csa64_fp8_ovl": ("csa", 64, 1, 512, "fp8", dict(fp8_overlap=True)),   # conversions interleaved with S wgmma
    "csa128_fp8_pdq": ("csa", 128, 1, 512, "fp8", dict(fp8_dequant="producer")),   # the producer dequantizes
    "csa16_fp8_pdq": ("csa", 16, 1, 512, "fp8", dict(fp8_dequant="producer", n_splits=4)),
    "csa128_fp8_cv": ("csa", 128, 1, 512, "fp8", dict(fp8_dequant="converter")),   # a fourth warpgroup converts
    "prefill2k_fp8_cv": ("csa", 1, 2048, 512, "fp8", dict(fp8_dequant="converter")),
    # session 25: the converter and the producer share each step's conversion (conv_units of 9 to the converter)
    "csa128_fp8_cv5": ("csa", 128, 1, 512, "fp8", dict(fp8_dequant="converter", conv_units=5)),
    "csa128_fp8_cv4": ("csa", 128, 1, 512, "fp8", dict(fp8_dequant="converter", conv_units=4)),
    "prefill2k_fp8_cv5": ("csa", 1, 2048, 512, "fp8", dict(fp8_dequant="converter", conv_units=5)),
    # ... and the diagonal chunk order (conflict-free shared-memory stores of the conversion)
    "csa128_fp8_dg": ("csa", 128, 1, 512, "fp8", dict(fp8_chunk_order="diagonal")),
    "csa128_fp8_cv_dg": ("csa", 128, 1, 512, "fp8", dict(fp8_dequant="converter", fp8_chunk_order="diagonal")),
    "csa128_fp8_cv5_dg": ("csa", 128, 1, 512, "fp8", dict(fp8_dequant="converter", conv_units=5,
                                                          fp8_chunk_order="diagonal")),
    # ... and a three-tile bf16 ring (two staging slots): built in session 25, not yet profiled
    "csa128_fp8_ts3": ("csa", 128, 1, 512, "fp8", dict(fp8_dequant="converter", tile_slots=3, num_stages=2)),
    "csa128_fp8_cv5_ts3": ("csa", 128, 1, 512, "fp8", dict(fp8_dequant="converter", conv_units=5, tile_slots=3,
                                                           num_stages=2)),
    # ... and a converting thread's chunks loaded in batches before their stores (session 26)
    "csa128_fp8_cb3": ("csa", 128, 1, 512, "fp8", dict(conv_batch=3)),
    "csa128_fp8_cb9": ("csa", 128, 1, 512, "fp8", dict(conv_batch=9)),
    "csa128_fp8_cb3_ts3": ("csa", 128, 1, 512, "fp8", dict(conv_batch=3, tile_slots=3, num_stages=2)),
    "csa128_lazy": ("csa", 128, 1, 512, "bf16", dict(lazy_rescale=True)),   # the lazy rescale (session 26)
    # the next step's scores in flight under this step's softmax (score_ahead, session 61; regions c_wait_full,
    # c_softmax, c_pv (issue), c_scores (waiting for S(g + 1) and the exchange), c_pv_wait)
    "csa128_fp8_ahead": ("csa", 128, 1, 512, "fp8", dict(score_ahead=True)),
    "csa128_fp8_ahead_cv5": ("csa", 128, 1, 512, "fp8", dict(score_ahead=True, conv_units=5)),
    "csa128_bk32_ahead": ("csa", 128, 1, 512, "bf16", dict(block_k=32, num_stages=4, score_ahead=True)),
    "csa128_fp8_lazy_cb3": ("csa", 128, 1, 512, "fp8", dict(lazy_rescale=True, conv_batch=3)),
    # session 67: the converter's conversion as four conversion instructions a pair (it had been "rebias")
    "csa128_fp8_rebias": ("csa", 128, 1, 512, "fp8", dict(fp8_convert="rebias")),
    "csa128_fp8_cvt": ("csa", 128, 1, 512, "fp8", dict(fp8_convert="cvt")),
    # ... and FlashMLA's consumer split over the converter's tiles
    "csa128_fp8_cv_asym": ("csa", 128, 1, 512, "fp8", dict(fp8_dequant="converter", consumers="asym")),
    # session 68: asym is the FP8 default, so the cases above without consumers now profile it; the pair, named
    "csa128_fp8_cv_pair": ("csa", 128, 1, 512, "fp8", dict(fp8_dequant="converter", consumers="pair")),
    # ... and asym with the converter storing raw bytes (wrong output): the phases without the conversion's cost
    "csa128_fp8_asym_noconv": ("csa", 128, 1, 512, "fp8", dict(consumers="asym", _diag="no_convert")),
    # session 69: f16 tensor-core operands (fp8_operands="f16"; the consumers' c_q_f16: q's conversion in place)
    "csa128_fp8_asym_f16": ("csa", 128, 1, 512, "fp8", dict(consumers="asym", fp8_operands="f16")),
    "csa128_fp8_asym_f16_owned": ("csa", 128, 1, 512, "fp8", dict(consumers="asym", fp8_operands="f16",
                                                                   fp8_chunk_order="owned")),
    # session 70: the producer's staging copies as 1-D bulk copies (fp8_copy="bulk")
    "csa128_fp8_asym_bulk": ("csa", 128, 1, 512, "fp8", dict(consumers="asym", fp8_copy="bulk")),
    "csa128_fp8_asym_f16_owned_bulk": ("csa", 128, 1, 512, "fp8", dict(consumers="asym", fp8_operands="f16",
                                                                        fp8_chunk_order="owned", fp8_copy="bulk")),
    # ... and a quarter of P.V moved from the scorer to the helper (asym_scorer_cols=128)
    "csa128_fp8_asym_sc128": ("csa", 128, 1, 512, "fp8", dict(consumers="asym", asym_scorer_cols=128)),
    "csa128_fp8_asym_f16_owned_sc128_bulk": ("csa", 128, 1, 512, "fp8", dict(
        consumers="asym", fp8_operands="f16", fp8_chunk_order="owned", fp8_copy="bulk", asym_scorer_cols=128)),
    # ... and q's first 256 columns in the scorer's registers (asym_q_regs)
    "csa128_fp8_asym_sc128_qr256": ("csa", 128, 1, 512, "fp8", dict(consumers="asym", asym_scorer_cols=128,
                                                                     asym_q_regs=256)),
    "csa128_fp8_asym_all70": ("csa", 128, 1, 512, "fp8", dict(
        consumers="asym", fp8_operands="f16", fp8_chunk_order="owned", fp8_copy="bulk", asym_scorer_cols=128,
        asym_q_regs=256)),
    # session 71: the five above are the defaults (csa128_fp8_cv_asym profiles them); session 70's defaults, named
    "csa128_fp8_s70_defaults": ("csa", 128, 1, 512, "fp8", dict(
        consumers="asym", fp8_operands="bf16", fp8_chunk_order="diagonal", fp8_copy="tma", asym_scorer_cols=256,
        asym_q_regs=0)),
    # FlashMLA's consumer split (consumers="asym", session 64): consumer 0 c_wait_full, c_scores, c_softmax (with
    # P's and alpha's stores), c_pv; consumer 1 c_wait_p (the named barrier) and c_pv. Its 215 KB leave room for
    # the profiler's records, which split_d's 32 KB exchange does not (the pair without split_d for comparison)
    "csa128_asym": ("csa", 128, 1, 512, "bf16", dict(consumers="asym")),
    "csa64_asym": ("csa", 64, 1, 512, "bf16", dict(consumers="asym")),
    "csa128_nosd": ("csa", 128, 1, 512, "bf16", dict(split_d=False)),
    "prefill2k_asym": ("csa", 1, 2048, 512, "bf16", dict(consumers="asym")),
    # ... over the direct FP8 gather (FlashMLA's FP8 shape), and the direct gather with the pair
    "csa128_fp8_direct_asym": ("csa", 128, 1, 512, "fp8", dict(fp8_dequant="direct", consumers="asym")),
    "csa128_fp8_direct": ("csa", 128, 1, 512, "fp8", dict(fp8_dequant="direct")),
    "csa64_cpa": ("csa", 64, 1, 512, "bf16", dict(producer="cp_async")),       # the cp.async producer
    "csa128_cpa": ("csa", 128, 1, 512, "bf16", dict(producer="cp_async")),
    "csa64_bk32": ("csa", 64, 1, 512, "bf16", dict(block_k=32, num_stages=4)),    # 32-entry steps, 4 slots
    "csa128_bk32": ("csa", 128, 1, 512, "bf16", dict(block_k=32, num_stages=4)),
    "csa64_idxf": ("csa", 64, 1, 512, "bf16", dict(idx_first=True)),            # index rows before the q tile
    "csa128_idxf": ("csa", 128, 1, 512, "bf16", dict(idx_first=True)),
    "csa64_pp": ("csa", 64, 1, 512, "bf16", dict(pingpong=True)),              # consumers take turns (wgmma)
    "csa128_pp": ("csa", 128, 1, 512, "bf16", dict(pingpong=True)),
    "csa16_cle": ("csa", 16, 1, 512, "bf16", dict(cluster_loads="early")),     # the merge's reads issued first
    "csa64_cle": ("csa", 64, 1, 512, "bf16", dict(cluster_loads="early")),
    "hca1k64_cle": ("hca", 64, 1, 1024, "bf16", dict(cluster_loads="early")),
    # with bf16 pools split_d, the pair's default since session 18, is off in every case here: the profiler's records
    # (2.5-3.3 KB) do not fit next to its 32 KB exchange buffer, the q tile and the two-slot ring at any split count
    # (session 18, call 5). FP8 pools with split_d (one staging slot) leave room: ~206 KB + the records.
    "prefill2k_pp": ("csa", 1, 2048, 512, "bf16", dict(split_scores=False, pingpong=True)),
    "prefill2k": ("csa", 1, 2048, 512, "bf16", {}),   # the default: split_scores until session 65, asym since 66
    "prefill2k_noss": ("csa", 1, 2048, 512, "bf16", dict(split_scores=False)),
}


def summarize(trace, clock_ghz=1.98, warpgroups=WARPGROUPS, roles_of=None):
    """A Mosaic GPU profiler trace (the dumped JSON as a dict) -> per role and region statistics. roles_of:
    warpgroup -> role name (default `ROLE`, this kernel's; the indexer's profile passes its own).

    Event times are SM clock cycles since the warpgroup's first record, plus the CTA's globaltimer start (ns), all
    divided by 1e3; within one warpgroup a difference of two times x 1e3 is cycles. Returns dict(roles={role:
    {region: dict(per_cta_cycles, count_per_cta, cycles_each, share)}, span_cycles}, n_ctas, start_spread_us)."""
    by_trace = defaultdict(list)
    for ev in trace["traceEvents"]:
        by_trace[int(ev["tid"]) - 1].append(ev)
    roles = {}
    spans = defaultdict(list)
    totals = defaultdict(lambda: defaultdict(float))
    counts = defaultdict(lambda: defaultdict(int))
    gaps = defaultdict(lambda: defaultdict(float))   # role -> "region -> next region" -> cycles between them
    starts = {}
    n_traces = defaultdict(int)
    for t, evs in by_trace.items():
        wg, cta = t % warpgroups, t // warpgroups
        role = (roles_of or ROLE)[wg]
        # in the dump's order, which is the record order within a warpgroup (a region's entry and exit can carry
        # the same time after the dump's overhead correction, so a sort could put the exit first)
        open_at = {}
        last_exit = None   # (name, ts) of the latest closed region: the time from it to the next entry is a gap
        for ev in evs:
            if ev["ph"] == "B":
                open_at[ev["name"]] = ev["ts"]
                if last_exit is not None and len(open_at) == 1:   # not inside another region
                    gaps[role][f"{last_exit[0]} -> {ev['name']}"] += (ev["ts"] - last_exit[1]) * 1e3
                last_exit = None
            elif ev["name"] in open_at:
                last_exit = (ev["name"], ev["ts"])
                totals[role][ev["name"]] += (ev["ts"] - open_at.pop(ev["name"])) * 1e3
                counts[role][ev["name"]] += 1
        spans[role].append((evs[-1]["ts"] - evs[0]["ts"]) * 1e3)
        n_traces[role] += 1
        starts[cta] = min(starts.get(cta, np.inf), evs[0]["ts"])
    for role in totals:
        n = n_traces[role]
        span = float(np.mean(spans[role]))
        regions = {}
        for name in sorted(totals[role], key=lambda k: -totals[role][k]):
            per_cta = totals[role][name] / n
            regions[name] = dict(per_cta_cycles=per_cta, count_per_cta=counts[role][name] / n,
                                 cycles_each=totals[role][name] / max(counts[role][name], 1), share=per_cta / span)
        outside = span - sum(r["per_cta_cycles"] for r in regions.values())
        regions["(outside regions)"] = dict(per_cta_cycles=outside, count_per_cta=0.0, cycles_each=0.0,
                                            share=outside / span)
        top = sorted(gaps[role].items(), key=lambda kv: -kv[1])[:6]
        roles[role] = dict(regions=regions, gaps={k: v / n for k, v in top}, span_cycles=span, span_cycles_max=float(np.max(spans[role])),
                           span_us=span / (clock_ghz * 1e3))
    st = np.array(sorted(starts.values()))   # the first record's time: globaltimer start (ns) / 1e3 = us
    return dict(roles=roles, n_ctas=len(starts), start_spread_us=float(st[-1] - st[0]) if len(st) else 0.0,
                clock_ghz=clock_ghz)


def run_profiled(plain, profiled, args, dump, warm_ms):
    """Calls plain(*args) once and then for warm_ms (so the SM clock has risen), then profiled(*args) three times;
    -> (the last trace the profiled calls dumped into dump, as a dict; the warm calls made). Older traces there
    are removed."""
    import jax

    jax.block_until_ready(plain(*args))
    n, t1 = 0, time.time()
    while (time.time() - t1) * 1e3 < warm_ms:
        jax.block_until_ready(plain(*args))
        n += 1
    for _ in range(3):
        jax.block_until_ready(profiled(*args))
    jax.effects_barrier()
    traces = sorted(glob.glob(os.path.join(dump, "*-trace.json")))
    if not traces:
        raise RuntimeError(f"no trace in {dump}: did the call take the profiled Mosaic kernel?")
    with open(traces[-1]) as f:
        trace = json.load(f)
    for tr in traces[:-1]:
        os.remove(tr)
    return trace, n


def print_summary(name, s, roles=("producer", "converter", "consumer")):
    print(f"== {name}: {s['n_ctas']} CTAs, CTA starts spread over {s['start_spread_us']:.1f} us "
          f"(cycles -> us at {s['clock_ghz']} GHz)", flush=True)
    for role in roles:
        if role not in s["roles"]:
            continue
        r = s["roles"][role]
        print(f"  {role}: span {r['span_cycles']:.0f} cycles ({r['span_us']:.2f} us) per CTA, max "
              f"{r['span_cycles_max']:.0f}", flush=True)
        for reg, v in r["regions"].items():
            print(f"    {reg:18s} {v['per_cta_cycles']:9.0f} cyc/CTA {100 * v['share']:5.1f}%   "
                  f"x{v['count_per_cta']:5.1f} of {v['cycles_each']:7.0f}", flush=True)
        for gap, cyc in r.get("gaps", {}).items():   # where the outside-regions time lies
            print(f"    gap {gap:32s} {cyc:9.0f} cyc/CTA", flush=True)


def add_profile_args(ap, summary, dump, cases):
    """A phase-profile script's options: --out (the summary file's directory), --dump (the raw traces), --cases,
    --clock-ghz, --warm-ms."""
    ap.add_argument("--out", default=".", help=f"the summary: DIR/{summary}")
    ap.add_argument("--dump", default=dump, help="the raw Chrome traces (large), per case")
    ap.add_argument("--cases", default=cases)
    ap.add_argument("--clock-ghz", type=float, default=1.98)
    ap.add_argument("--warm-ms", type=float, default=200.0, help="unprofiled calls first, so the SM clock has risen")
    return ap


def main():
    args = add_profile_args(argparse.ArgumentParser(), "mosaic_phase_profile.json", "/tmp/mosaic_profile_traces",
                            "csa64,csa128,csa16,hca8k16,csa64_ns1,prefill2k,prefill2k_noss,csa64_fp8").parse_args()

    import jax

    from benchmarks.sparse_attention import D, make_case
    from benchmarks.timing import record_case
    from pallas_kernels.sparse_attention import gpu_mosaic
    from pallas_kernels.sparse_attention.gpu_mosaic import sparse_attention_mosaic

    # the warpgroups per CTA come from the kernel actually built (a fourth, the converter, wherever the FP8 default
    # or an option picks fp8_dequant="converter"), not from the case's options: session 26's profiles of cases
    # that took the converter by default split each CTA's traces over the wrong roles
    built = []
    real_build, bind = gpu_mosaic._build, inspect.signature(gpu_mosaic._build).bind
    gpu_mosaic._build = lambda *a, **kw: built.append(bind(*a, **kw).arguments) or real_build(*a, **kw)

    rng = np.random.default_rng(0)
    results = {}
    for name in args.cases.split(","):
        kind, b, t_q, kc, kv, opts = CASES[name]
        dump = os.path.join(args.dump, name)
        os.makedirs(dump, exist_ok=True)
        q, wpool, cpool, sinks, widx, cidx = make_case(rng, kind, b, t_q, kc, max(4096, t_q // 4), kv == "fp8", 1)
        a = (q, wpool, widx[0], cpool, cidx[0], sinks)
        plain = jax.jit(lambda *x: sparse_attention_mosaic(*x, scale=D ** -0.5, **opts))
        profiled = jax.jit(lambda *x: sparse_attention_mosaic(*x, scale=D ** -0.5, _profile=dump, **opts))

        def measure():
            t0 = time.time()
            trace, n = run_profiled(plain, profiled, a, dump, args.warm_ms)
            s = summarize(trace, args.clock_ghz, warpgroups=4 if built[-1].get("conv") else WARPGROUPS)
            s["case"] = dict(kind=kind, B=b, T=t_q, Kc=kc, kv=kv, opts=opts, warm_calls=n,
                             seconds=round(time.time() - t0, 1))
            print_summary(name, s)
            return s

        record_case(results, name, os.path.join(args.out, "mosaic_phase_profile.json"), measure)

if __name__ == "__main__":
    sys.path[:0] = ["."]
    main()
