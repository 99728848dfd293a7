"""Which kernels one indexer call launches on the GPU, and how its time splits into kernels and gaps (H200 diagnostic).

The fp8-key indexer decode at B = 64 x 128K context takes ~140 us against a 73 us memory floor; the scores kernel
is ~100 us of it, the threshold top-k (a chain of XLA fusions and Triton kernels) the rest. This lists every kernel
of U dependent calls (q_{i+1} depends on picks_i) with its CUPTI duration, so the top-k's share is split into its
stages and the idle gaps between them (since session 41 the dependency is `benchmarks.indexer.dependent_q`, one
small fusion a call; the config "harness" times it alone):

  net/call       (wall of 2U chained calls - wall of U) / U: the steady-state time per call, no dispatch share
  kernels/call   the sum of the CUPTI kernel durations / U
  gaps/call      net - kernels: the GPU's idle time between kernels

    PYTHONPATH=. python benchmarks/indexer_kernels.py --out DIR [--cases 64x1x131072xfp8] \
        [--configs 'harness;kernel=mosaic;kernel=mosaic,fuse_group_max=1'] [--unroll 8] [--hlo]

A config is a ','-separated option set of `indexer_topk(..., impl="pallas", k=512, topk="threshold_set")`
(ints, flags as 0 / 1; topk=... replaces the method; topk.NAME=value sets a constant of the top-k module, see
`benchmarks.indexer.set_pipeline`). Needs a GPU (CUPTI).
"""

from __future__ import annotations

import argparse
import os
import sys



def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--cases", default="64x1x131072xfp8")
    ap.add_argument("--configs", default="kernel=mosaic;kernel=mosaic,fuse_group_max=1")
    ap.add_argument("--unroll", type=int, default=8)
    ap.add_argument("--hlo", action="store_true", help="also write each chain's compiled HLO to --out")
    args = ap.parse_args()

    import jax

    from benchmarks.decode_kernels import group_kernels
    from benchmarks.indexer import dependent_q, harness_out, make_inputs, set_pipeline
    from benchmarks.timing import cupti_kernels, record_case, wall_net

    u = args.unroll
    results = {}
    for cs in args.cases.split(","):
        B, S, ctx, fmt = cs.split("x")
        q, w, keys, nv = make_inputs(int(B), int(S), int(ctx), fmt)
        for cfg in args.configs.split(";"):
            # "harness": the chain's own dependency pass alone (benchmarks.indexer.harness_out)
            pipeline = harness_out if cfg == "harness" else set_pipeline(cfg)   # flags as 0 / 1

            def chain(n, pipeline=pipeline):
                def run(q, w, keys, nv):
                    for _ in range(n):   # unrolled: CUPTI sees each call's kernels
                        q = dependent_q(q, pipeline(q, w, keys, nv))   # one small fusion, as indexer.py's chain
                    return q
                return jax.jit(run)

            def measure(chain=chain):
                a = (q, w, keys, nv)
                net, _ = wall_net(chain, *a, n1=u, n2=2 * u)
                kernels = group_kernels(cupti_kernels(chain(u), *a), u)
                if args.hlo:   # which fusion is which: the compiled program's text
                    # letters, digits and ._- only: the device tool returns no file whose name has '=' or ','
                    name = "".join(c if c.isalnum() or c in "._-" else "_" for c in f"{cs}_{cfg}")[:150]
                    with open(os.path.join(args.out, f"ikern_hlo_{name}.txt"), "w") as fh:
                        fh.write(chain(u).lower(*a).compile().as_text())
                k_sum = sum(v["us_per_call"] for v in kernels.values())
                print(f"== {cs} [{cfg}]: net {net * 1e6:7.1f} us/call, kernels {k_sum:7.1f}, "
                      f"gaps {net * 1e6 - k_sum:6.1f}", flush=True)
                for k, v in kernels.items():
                    print(f"    {v['per_call']:4.1f} x {v['us_each']:7.2f} us  {k[:100]}", flush=True)
                return dict(case=cs, config=cfg, net_us=net * 1e6, kernels_us=k_sum, gaps_us=net * 1e6 - k_sum,
                            kernels=kernels)

            record_case(results, f"{cs}[{cfg}]", os.path.join(args.out, "indexer_kernels.json"), measure)


if __name__ == "__main__":
    sys.path[:0] = ["."]
    main()
