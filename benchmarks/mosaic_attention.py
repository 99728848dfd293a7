"""The warp-specialised Mosaic GPU sparse-attention kernel (pallas_kernels/sparse_attention/gpu_mosaic.py) on the H200:
correctness against the reference, then time next to the Triton kernel's defaults on the same inputs.

    PYTHONPATH=. python benchmarks/mosaic_attention.py --out DIR [--quick]

Checks: random -1 / out-of-range / duplicate entries, ragged lengths (one all-empty compressed list), 1 and several
splits. Timing: decode (T=1) CSA 128 + 512 at B=16/64/128 and HCA 128 + 8K at B=16, bf16 pools, the
op called U times as a dependent chain (q_{k+1} = o_k) in one jitted function over disjoint row copies; the time per
call is (wall(U2) - wall(U1)) / (U2 - U1), so the 100-250 us of Python dispatch cancels. Floor: valid gathered rows
once + q read + o written, at the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.sparse_attention import D, H, W, make_case, per_call
from benchmarks.timing import measure_ceilings
from pallas_kernels.sparse_attention.fp8_layout import ROW_BYTES
from pallas_kernels.sparse_attention import quantize_kv_fp8, sparse_attention
from pallas_kernels.sparse_attention.gpu_mosaic import sparse_attention_mosaic


def check(rng, b, kc, opts, fp8=False):
    k = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 4)
    nw, nc = 300, 2000
    wpool = jax.random.normal(k[0], (nw, D), jnp.bfloat16)
    cpool = jax.random.normal(k[1], (nc, D), jnp.bfloat16)
    q = jax.random.normal(k[2], (b, 1, H, D), jnp.bfloat16)
    sinks = jax.random.normal(k[3], (H,), jnp.float32)
    if fp8:
        wpool, cpool = quantize_kv_fp8(wpool), quantize_kv_fp8(cpool)
    widx = rng.integers(-1, nw, (b, 1, W)).astype(np.int32)
    widx[:, :, 5] = widx[:, :, 6]                                    # a duplicate entry
    cidx = rng.integers(-1, nc + 5, (b, 1, kc)).astype(np.int32)     # -1 and out-of-range entries
    wlen = rng.integers(1, W + 1, (b, 1)).astype(np.int32)
    clen = rng.integers(0, kc + 1, (b, 1)).astype(np.int32)
    clen[0, 0] = 0                                                   # an empty compressed list
    args = (q, wpool, jnp.asarray(widx), cpool, jnp.asarray(cidx), sinks)
    kw = dict(scale=D ** -0.5, window_len=jnp.asarray(wlen), compressed_len=jnp.asarray(clen), return_lse=True)
    o_r, l_r = sparse_attention(*args, impl="reference", **kw)
    o_m, l_m = jax.jit(lambda *a: sparse_attention_mosaic(*a, **kw, **opts))(*args)
    o_r, o_m = np.asarray(o_r, np.float32), np.asarray(o_m, np.float32)
    err = float(np.linalg.norm(o_m - o_r) / np.linalg.norm(o_r))
    l_r, l_m = np.asarray(l_r), np.asarray(l_m)
    fin = np.isfinite(l_r)
    lerr = float(np.max(np.abs(l_m[fin] - l_r[fin]))) if fin.any() else 0.0
    return dict(b=b, kc=kc, opts=opts, kv="fp8" if fp8 else "bf16", rel_err=err, lse_max_abs_err=lerr, nan=bool(np.isnan(o_m).any()),
                lse_inf_match=bool(np.array_equal(np.isfinite(l_m), fin)), ok=err < 1e-2 and lerr < 1e-2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--cases", default="decode",
                    help="decode | prefill (CSA S=4096, B=1) | splits (B=64 n_splits) | fp8 (FP8 pools: decode + prefill) "
                         "| heads128 (V4-Pro's 128 heads: decode + prefill, bf16 pools) "
                         "| ss (split_scores vs the default: CSA decode B=64 / 128, prefill S=4K)")
    ap.add_argument("--rounds", type=int, default=1, help="time the variants this many times, interleaved")
    ap.add_argument("--no-checks", action="store_true", help="skip the correctness checks (pytest covers them)")
    ap.add_argument("--variants", default=None, help="comma-separated variant names to time (default: all)")
    ap.add_argument("--regs", default=None,
                    help="also time the Mosaic kernel with these setmaxnreg splits, e.g. '40,232;24,240'")
    ap.add_argument("--diag", action="store_true",
                    help="fp8: also time the kernel without dequantization / without scale copies (wrong output)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    res = dict(checks=[], timings=[])
    for b, kc, opts in [(2, 512, dict(n_splits=1)), (3, 512, dict(n_splits=3)), (2, 1024, {}),
                        (5, 256, dict(n_splits=2))][:(4 if args.cases in ("decode", "fp8") and not args.no_checks else 0)]:
        t0 = time.time()
        try:
            r = check(rng, b, kc, opts, fp8=args.cases == "fp8")
        except Exception as e:
            r = dict(b=b, kc=kc, opts=opts, ok=False, error=f"{type(e).__name__}: {str(e)[:800]}")
        r["s"] = round(time.time() - t0, 1)
        print("check", r, flush=True)
        res["checks"].append(r)
    ceil = measure_ceilings(quick=True)
    print("ceilings", ceil, flush=True)
    cases = {"decode": [("csa", 64, 512, 1), ("csa", 16, 512, 1), ("csa", 128, 512, 1), ("hca", 16, 8192, 1)],
             "prefill": [("csa", 1, 512, 4096), ("csa", 1, 512, 16384)], "splits": [("csa", 64, 512, 1)],
             "fp8": [("csa", 64, 512, 1), ("csa", 16, 512, 1), ("csa", 128, 512, 1), ("hca", 16, 8192, 1),
                     ("csa", 1, 512, 4096)],
             "ss": [("csa", 64, 512, 1), ("csa", 128, 512, 1), ("csa", 1, 512, 4096)],
             "heads128": [("csa", 64, 512, 1, 128), ("csa", 16, 512, 1, 128), ("csa", 128, 512, 1, 128),
                          ("hca", 16, 8192, 1, 128), ("csa", 1, 512, 4096, 128)]}[args.cases]
    fp8 = args.cases == "fp8"
    if fp8 and args.diag:
        cases = cases[:1] + cases[2:3]   # CSA B=64 and B=128
    if args.quick:
        cases = cases[:1]
    for kind, b, kc, t_q, *hh in cases:
        heads = hh[0] if hh else H
        entries = b * t_q * (W + kc)
        floor_bytes = entries * (ROW_BYTES if fp8 else 2 * D) + 2 * b * t_q * heads * D * 2
        flops = 4 * heads * D * entries
        floor_s = max(floor_bytes / (ceil["copy_GBps"] * 1e9), flops / (ceil["bf16_TFLOPs"] * 1e12))
        n_copies = int(min(16, max(1, math.ceil(256e6 / (entries * 2 * D))))) if t_q == 1 else 1
        case = make_case(rng, kind, b, t_q, kc, 4096, fp8, n_copies, heads)
        variants = [("triton", lambda *a: sparse_attention(*a, scale=D ** -0.5, impl="pallas", kernel="triton")),
                    ("mosaic", lambda *a: sparse_attention_mosaic(*a, scale=D ** -0.5))]
        if not fp8:
            variants += [(f"mosaic_{n}", lambda *a, v=v: sparse_attention_mosaic(*a, scale=D ** -0.5, split_scores=v))
                         for n, v in (("ss", True), ("noss", False))]   # "mosaic": the default (split_scores on from T = 64)
        if args.cases == "splits":
            variants = [(f"mosaic_ns{n}", lambda *a, n=n: sparse_attention_mosaic(*a, scale=D ** -0.5, n_splits=n))
                        for n in (2, 3, 4)]
        elif fp8 and args.diag and t_q == 1:
            variants += [(f"mosaic_{dg}", lambda *a, dg=dg: sparse_attention_mosaic(*a, scale=D ** -0.5, _diag=dg))
                         for dg in ("loop", "no_convert", "no_dequant", "no_scales")]
        elif fp8 and kind == "csa" and b == 64:
            variants += [("mosaic_bits", lambda *a: sparse_attention_mosaic(*a, scale=D ** -0.5, _diag="bits"))]
        elif kind == "csa" and b == 64:
            variants += [("mosaic_ns1", lambda *a: sparse_attention_mosaic(*a, scale=D ** -0.5, n_splits=1))]
        for rg in (args.regs.split(";") if args.regs else []):
            p_, c_ = (int(x) for x in rg.split(","))
            variants += [(f"mosaic_r{p_}_{c_}", lambda *a, rg=(p_, c_): sparse_attention_mosaic(*a, scale=D ** -0.5,
                                                                                             regs=rg))]
        if args.variants:
            variants = [v for v in variants if v[0] in args.variants.split(",")]
        for rnd, (name, fn) in [(i, v) for i in range(args.rounds) for v in variants]:
            try:
                t = per_call(fn, case, 8, 8 + 4 * max(8, n_copies)) if t_q == 1 else per_call(fn, case, 1, 3)
                r = dict(kind=kind, B=b, T=t_q, Kc=kc, H=heads, kv="fp8" if fp8 else "bf16", variant=name, round=rnd, us=t * 1e6, floor_us=floor_s * 1e6,
                         ratio=t / floor_s, GBps=floor_bytes / t / 1e9, TFLOPs=flops / t / 1e12)
            except Exception as e:
                r = dict(kind=kind, B=b, Kc=kc, variant=name, error=f"{type(e).__name__}: {str(e)[:600]}")
            print("time", r, flush=True)
            res["timings"].append(r)
    with open(os.path.join(args.out, f"mosaic_attention_{args.cases}.json"), "w") as f:
        json.dump(dict(ceilings=ceil, **res), f, indent=1)


if __name__ == "__main__":
    main()
