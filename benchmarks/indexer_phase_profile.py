"""Where does the Mosaic indexer kernel's time go? Each warpgroup's phases a key block, from Mosaic GPU's profiler.

fp4 keys at B = 64 x 128K context run at 1.5-1.6x the H100's memory floor and ~2.2x the H200's (sessions 51-73):
their scores kernel alone takes ~65-70 us on either card, so not the bytes but the SM's own work a block sets its
pace. The converter warpgroup (session 49) took the nibble conversion off the scoring warpgroup's chain, but which
of the two, or the key stream, or the selection after the last block binds was inferred from probes (no conversion,
no epilogue, no selection), never measured. This runs the model's pipeline (`indexer_topk(..., topk="auto_set")`,
the segment top-k for these shapes) with MOSAIC_CONFIG["profile"] (gpu_mosaic.py): thread 0 of each warpgroup
stamps the SM clock at the entry and exit of `gpu_mosaic.PROFILE_REGIONS`,

  scorer     s_wait_q once; per block s_wait (its e5m2 slot converted; fp8 / bf16 keys: the block landed), s_mma
             (wgmma issue and wait; with conv_sync "arrive" the key copies' issue is in s_wait), s_epilogue
             (the slot's release, ReLU x weight, head sum, mask, the segment store and its ordering: seg_sync),
             s_hist (the streamed histogram, the pruned list); s_select once (the split's selection after its last
             block, and the "last" final where a CTA runs it)
  converter  per block c_wait_keys (the packed keys landed), c_convert (nibbles -> e5m2 in registers), c_wait_slot
             (the scorer released the slot it writes), c_store (the stores, the async-proxy fence, the arrival,
             the next key copy)
  seg_hist "converter" moves s_hist to the converter (c_wait_seg, c_hist a block; the scorer's s_wait_hist once),
  and select_wgs 2 adds the converter's c_select once (its share of the selection, beside the scorer's s_select)

and prints per role and region the cycles a CTA and a block, and the CTAs' start spread (waves). Reading: a
converter that waits in c_wait_slot is paced by the scorer; a scorer that waits in s_wait by the converter (or,
with c_wait_keys large, by the key stream); s_select against the span is the tail no CTA overlaps.

    PYTHONPATH=.:tests python benchmarks/indexer_phase_profile.py --out DIR [--cases fp4_64x128k,...]

The records cost shared memory (`gpu_mosaic.profile_words_per_block` x 4 B a block and warpgroup): fp4 at B = 64 x
128K still fits 2 CTAs an SM (115000 B, offline), fp8 keys there do not (118944 B: 1 CTA an SM), so an fp8 profile
at that shape is not the timed kernel's schedule. The "_detail" cases (MOSAIC_CONFIG["profile_detail"]) record the
ordering work apart (s_sync: the scorer's barrier after a block's scores; c_commit: the converter's async-proxy
fence, barrier, arrival and next copy): one region more a block, so they run at 64K context, whose splits of 32
blocks leave room for it. Needs a Hopper GPU; the reader is tested on the CPU
(tests/test_mosaic_profile_summary.py).
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import time

# name -> (B, context, key format, pipeline config: benchmarks/indexer.py's set_pipeline options)
CASES = {
    "fp4_64x128k": (64, 131072, "fp4", "topk=auto_set"),           # the row at 1.5-1.6x (H100)
    "fp4_64x128k_noselect": (64, 131072, "fp4", "topk=auto_set,sel.probe=1"),   # no selection after the stream
    "fp4_64x128k_cv1": (64, 131072, "fp4", "topk=auto_set,mosaic.fp4_converter=1"),   # one e5m2 slot
    "fp4_16x128k": (16, 131072, "fp4", "topk=auto_set"),
    "fp4_64x64k": (64, 65536, "fp4", "topk=auto_set"),
    "fp4_64x64k_detail": (64, 65536, "fp4", "topk=auto_set,mosaic.profile_detail=1"),
    "fp4_64x64k_commit_detail": (64, 65536, "fp4", "topk=auto_set,mosaic.profile_detail=1,mosaic.seg_sync=commit"),
    # conv_sync "arrive" (session 74; not yet run on a GPU): the converter's hand-over without a warpgroup barrier
    "fp4_64x128k_arrive": (64, 131072, "fp4", "topk=auto_set,mosaic.conv_sync=arrive"),
    "fp4_64x64k_arrive_detail": (64, 65536, "fp4", "topk=auto_set,mosaic.profile_detail=1,mosaic.conv_sync=arrive"),
    # conv_sync "early" (session 75): the converter issues the key copies right after the conversion
    "fp4_64x128k_early": (64, 131072, "fp4", "topk=auto_set,mosaic.conv_sync=early"),
    "fp4_64x64k_early_detail": (64, 65536, "fp4", "topk=auto_set,mosaic.profile_detail=1,mosaic.conv_sync=early"),
    # seg_hist "converter" (session 75): the converter counts the streamed histogram (2 regions more a block: 64K)
    "fp4_64x64k_hist": (64, 65536, "fp4", "topk=auto_set,mosaic.seg_hist=converter"),
    "fp4_64x64k_early_hist": (64, 65536, "fp4", "topk=auto_set,mosaic.seg_hist=converter,mosaic.conv_sync=early"),
    # select_wgs 2 (session 76): the converter warpgroup joins the selection (its c_select, once a CTA)
    "fp4_64x64k_early_hist_s2": (64, 65536, "fp4",
                                 "topk=auto_set,mosaic.seg_hist=converter,mosaic.conv_sync=early,mosaic.select_wgs=2"),
    # ... and q_prep "fused" (session 76): the scorer prepares q (in its s_wait_q, once a CTA)
    "fp4_64x64k_all": (64, 65536, "fp4", "topk=auto_set,mosaic.seg_hist=converter,mosaic.conv_sync=early,"
                                         "mosaic.select_wgs=2,mosaic.q_prep=fused"),
    "fp8_64x128k": (64, 131072, "fp8", "topk=auto_set"),           # 1 CTA an SM with the records (see above)
}
ROLES = {0: "scorer", 1: "converter"}   # warpgroup -> role (fp8 / bf16 keys: the scorer alone)


def per_block(summary):
    """{role: {region: cycles a block}} from `summarize`'s per-CTA figures and the blocks a CTA scored (the count of
    s_wait a CTA)."""
    roles = summary["roles"]
    blocks = roles.get("scorer", {}).get("regions", {}).get("s_wait", {}).get("count_per_cta", 0.0)
    if not blocks:
        return {}
    return {role: {**{reg: v["per_cta_cycles"] / blocks for reg, v in r["regions"].items()},
                   "(span)": r["span_cycles"] / blocks} for role, r in roles.items()}


def main():
    from benchmarks.mosaic_phase_profile import add_profile_args, print_summary, run_profiled, summarize

    args = add_profile_args(argparse.ArgumentParser(description=__doc__,
                                                    formatter_class=argparse.RawDescriptionHelpFormatter),
                            "indexer_phase_profile.json", "/tmp/indexer_profile_traces",
                            "fp4_64x128k,fp4_64x128k_noselect,fp4_16x128k,fp8_64x128k").parse_args()

    import jax

    from benchmarks.indexer import make_inputs, set_pipeline
    from benchmarks.timing import record_case

    results = {}
    for name in args.cases.split(","):
        if name not in CASES:
            raise SystemExit(f"unknown case {name!r}; known: {', '.join(CASES)}")
        B, ctx, fmt, cfg = CASES[name]
        dump = os.path.join(args.dump, name)
        os.makedirs(dump, exist_ok=True)
        for old in glob.glob(os.path.join(dump, "*-trace.json")):
            os.remove(old)
        q, w, keys, nv = make_inputs(B, 1, ctx, fmt)
        plain = jax.jit(set_pipeline(cfg))
        profiled = jax.jit(set_pipeline(f"{cfg},mosaic.profile={dump}"))

        def measure():
            t0 = time.time()
            trace, n = run_profiled(plain, profiled, (q, w, keys, nv), dump, args.warm_ms)
            # two warpgroups a CTA where the converter recorded (fp4 keys), else the scorer alone
            wgs = 2 if any(e["name"].startswith("c_") for e in trace["traceEvents"]) else 1
            s = summarize(trace, args.clock_ghz, warpgroups=wgs, roles_of=ROLES)
            s["per_block_cycles"] = per_block(s)
            s["case"] = dict(B=B, ctx=ctx, fmt=fmt, cfg=cfg, warm_calls=n, seconds=round(time.time() - t0, 1))
            print_summary(name, s, roles=("converter", "scorer"))
            for role, regs in s["per_block_cycles"].items():
                print(f"  {role} a block: " + ", ".join(f"{k} {v:.0f}" for k, v in regs.items()), flush=True)
            return s

        record_case(results, name, os.path.join(args.out, "indexer_phase_profile.json"), measure)


if __name__ == "__main__":
    sys.path[:0] = ["."]
    main()
