"""What one sparse-attention decode call launches on the GPU, and how its wall time splits into kernels and gaps.

The Mosaic kernel's own phase profile (mosaic_phase_profile.py, session 14) puts a CTA's span at ~22 us for CSA
B=64 while the op takes ~40 us per call in sparse_attention.py's chain. This times the same chain (U dependent
calls, q_{k+1} = o_k, rotating index sets) and, through CUPTI (Mosaic GPU's `profiler.measure`), lists every kernel
it launches with its duration, so the time outside the attention kernel (index clean-up, split-K combine, casts,
launch gaps) is measured rather than guessed:

  wall/call      the chain's wall time / U (Python dispatch shared by U calls)
  net/call       (wall of 2U chained calls - wall of U) / U: the steady-state time per call, no dispatch share
  host/call      the time until the jitted chain's call returns (its kernels enqueued, not finished) / U: if it
                 is near net/call, the host's per-call launch work, not the GPU, sets the pace
  kernels/call   the sum of the CUPTI kernel durations / U
  gaps/call      net - kernels: the GPU's idle time between the kernels of one call and the next

    PYTHONPATH=. python benchmarks/decode_kernels.py --out DIR [--cases csa64,csa64:kernel=mosaic+producer=cp_async,...] [--unroll 16]

A case is NAME[:opt=value+opt=value...] with NAME as CASE_NAME reads it (csa<B>, hca<N>k<B>, + _fp8, + _h<heads>:
csa64, hca8k136_fp8, hca8k72_h128) and options passed to `sparse_attention` (ints, a/b for a
tuple of ints, or true / false),
except wlen / clen: every row's valid window / compressed length (wlen=0+clen=0: the kernel's fixed cost, no blocks).
Needs a GPU (CUPTI).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from collections import defaultdict

import numpy as np

# a case's name: csa<B> (128 window + 512 top-k entries a row) or hca<N>k<B> (128 + N x 1024), + _fp8 for FP8 pools,
# + _h<H> for H query heads (64 by default; 128 = V4-Pro's two head groups)
CASE_NAME = re.compile(r"^(csa|hca(\d+)k)(\d+)(_fp8)?(?:_h(\d+))?$")


def case_shape(name):
    """A case name -> (kind, B, K_c, kv, heads)."""
    m = CASE_NAME.match(name)
    if not m:
        raise ValueError(f"unknown case {name!r}: csa<B> or hca<N>k<B>, optionally + _fp8, + _h<heads>")
    kind, kc = ("csa", 512) if m.group(1) == "csa" else ("hca", int(m.group(2)) * 1024)
    return kind, int(m.group(3)), kc, "fp8" if m.group(4) else "bf16", int(m.group(5) or 64)


def parse_case(spec):
    name, _, rest = spec.partition(":")
    opts = {}
    for kv in filter(None, rest.split("+")):
        k, v = kv.split("=")
        opts[k] = {"true": True, "false": False}.get(v.lower(), v)
        if isinstance(opts[k], str) and "/" in v:   # a tuple of ints, e.g. regs=96/208
            opts[k] = tuple(int(x) for x in v.split("/"))
        elif isinstance(opts[k], str):
            try:
                opts[k] = int(v)
            except ValueError:
                pass
    return name, opts


def group_kernels(timings, unroll):
    """CUPTI [(kernel name, us), ...] over the chain -> {name: dict(per_call, us_each)} (launches per call, mean us)."""
    by = defaultdict(list)
    for name, us in timings:
        by[name].append(us)
    return {k: dict(per_call=len(v) / unroll, us_each=float(np.mean(v)), us_per_call=float(np.sum(v)) / unroll)
            for k, v in sorted(by.items(), key=lambda kv: -sum(kv[1]))}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--cases", default="csa16,csa64,csa128,hca8k16,csa64_fp8")
    ap.add_argument("--unroll", type=int, default=16)
    ap.add_argument("--name", default="decode_kernels", help="the JSON file's name in --out (one per XLA_FLAGS run)")
    args = ap.parse_args()

    import jax

    from benchmarks.sparse_attention import chained, dispatcher_call, make_case
    from benchmarks.timing import cupti_kernels, record_case, wall, wall_net

    rng = np.random.default_rng(0)
    u = args.unroll
    results = {}
    for spec in args.cases.split(","):
        name, opts = parse_case(spec)
        kind, b, kc, kv, heads = case_shape(name)

        def measure():
            q, wpool, cpool, sinks, widx, cidx = make_case(rng, kind, b, 1, kc, 4096, kv == "fp8", 8, heads)
            kopts = dict(opts)
            lens = {k: kopts.pop(k) for k in ("wlen", "clen") if k in kopts}
            if lens:   # valid lengths for every row: wlen=0+clen=0 times the kernel's fixed cost (no blocks)
                from pallas_kernels.sparse_attention import sparse_attention
                from benchmarks.sparse_attention import D
                full = lambda n: jax.numpy.full((b, 1), n, jax.numpy.int32)
                one = jax.jit(lambda q, wpool, widx, cpool, cidx, sinks: sparse_attention(
                    q, wpool, widx, cpool, cidx, sinks, scale=D ** -0.5, impl="pallas",
                    window_len=full(lens.get("wlen", widx.shape[-1])),
                    compressed_len=full(lens.get("clen", cidx.shape[-1])), **kopts))
            else:
                one = dispatcher_call("pallas", opts)
            chain = lambda n: chained(one, n, len(widx))
            a = (q, wpool, cpool, sinks, widx, cidx)
            run = chain(u)
            w = wall(run, *a, reps=5) / u
            net, _ = wall_net(chain, *a, n1=u, n2=2 * u)
            host = []
            for _ in range(5):   # enqueue time: the call returns once its kernels are queued
                jax.block_until_ready(run(*a))
                t0 = time.perf_counter()
                out = run(*a)
                host.append(time.perf_counter() - t0)
                jax.block_until_ready(out)
            host = float(np.median(host)) / u
            kernels = group_kernels(cupti_kernels(run, *a), u)
            k_sum = sum(v["us_per_call"] for v in kernels.values())
            print(f"== {spec}: wall {w * 1e6:7.1f} us/call, net {net * 1e6:7.1f}, host {host * 1e6:7.1f}, "
                  f"kernels {k_sum:7.1f}, gaps {net * 1e6 - k_sum:6.1f}", flush=True)
            for k, v in kernels.items():
                print(f"    {v['per_call']:4.1f} x {v['us_each']:7.2f} us  {k[:90]}", flush=True)
            return dict(case=spec, wall_us=w * 1e6, net_us=net * 1e6, host_us=host * 1e6, kernels_us=k_sum,
                        gaps_us=net * 1e6 - k_sum, kernels=kernels, xla_flags=os.environ.get("XLA_FLAGS", ""))

        record_case(results, spec, os.path.join(args.out, args.name + ".json"), measure)

if __name__ == "__main__":
    sys.path[:0] = ["."]
    main()
