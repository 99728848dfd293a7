"""Which kernels one indexer call launches on the GPU, and how its time splits into kernels and gaps (H200 diagnostic).

The fp8-key indexer decode at B = 64 x 128K context takes ~140 us against a 73 us memory floor; the scores kernel
is ~100 us of it, the threshold top-k (a chain of XLA fusions and Triton kernels) the rest. This lists every kernel
of U dependent calls (q_{i+1} depends on picks_i) with its CUPTI duration, so the top-k's share is split into its
stages and the idle gaps between them:

  net/call       (wall of 2U chained calls - wall of U) / U: the steady-state time per call, no dispatch share
  kernels/call   the sum of the CUPTI kernel durations / U
  gaps/call      net - kernels: the GPU's idle time between kernels

    PYTHONPATH=. python benchmarks/indexer_kernels.py --out DIR [--cases 64x1x131072xfp8] \
        [--configs 'kernel=mosaic;kernel=mosaic,fuse_group_max=1'] [--unroll 8]

A config is a ','-separated option set of `indexer_topk(..., impl="pallas", k=512, topk="threshold_set")`
(ints, flags as 0 / 1; topk=... replaces the method; topk.NAME=value sets a constant of the top-k module, see
`benchmarks.indexer.set_pipeline`). Needs a GPU (CUPTI).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--cases", default="64x1x131072xfp8")
    ap.add_argument("--configs", default="kernel=mosaic;kernel=mosaic,fuse_group_max=1")
    ap.add_argument("--unroll", type=int, default=8)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp

    from benchmarks.decode_kernels import group_kernels
    from benchmarks.indexer import make_inputs, set_pipeline
    from benchmarks.timing import cupti_kernels, record_case, wall_net

    u = args.unroll
    results = {}
    for cs in args.cases.split(","):
        B, S, ctx, fmt = cs.split("x")
        q, w, keys, nv = make_inputs(int(B), int(S), int(ctx), fmt)
        for cfg in args.configs.split(";"):
            pipeline = set_pipeline(cfg)   # flags as 0 / 1; topk.NAME=value sets a constant of the top-k module

            def chain(n, pipeline=pipeline):
                def run(q, w, keys, nv):
                    acc = jnp.zeros((), jnp.int32)
                    for _ in range(n):   # unrolled: CUPTI sees each call's kernels
                        picks = pipeline(q, w, keys, nv)
                        dep = jnp.sum(picks[..., :1])
                        q = q + 0.0 * dep.astype(q.dtype)
                        acc = acc + dep
                    return acc
                return jax.jit(run)

            def measure(chain=chain):
                a = (q, w, keys, nv)
                net, _ = wall_net(chain, *a, n1=u, n2=2 * u)
                kernels = group_kernels(cupti_kernels(chain(u), *a), u)
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
