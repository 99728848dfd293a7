"""What one block-wide step costs inside a Pallas Triton program (H200 diagnostic for `topk_hist`, session 33).

A one-program-per-row top-k is a chain of dependent block-wide steps (reductions, scans, histograms); this times each
kind alone: grid (R,) programs of `num_warps` warps, each holding x [N] int32 (and h [2048]) in registers and
applying the step `iters` times in a loop (each iteration depends on the last). µs per step =
(time(iters = n2) - time(iters = n1)) / (n2 - n1), the launch and the loads cancelled; the calls themselves are
timed as dependent calls in one jitted scan (`timing.wall_net`).

    PYTHONPATH=. python benchmarks/triton_block_ops.py [--rows 64] [--n 16384] [--warps 16] [--ops a,b]

ops: noop (x + 1: the loop itself), reduce (a sum over x), cumsum (a scan over x), hist (a 2048-bin `histogram`
of x's low bits, every lane counted), hist_sparse (the same, 1 lane in 32 counted), hist_hot (4 bins: every atomic
on the same few counters), cumsum2k (a scan over the [2048] counters), pick2k (`topk_hist._pick_bin`: a scan and two
reductions over them), scan2d (the two-level scan: x as [N / 16, 16], a scan along the rows' 16 lanes, a scan
over the N / 16 row sums, added back).
"""

from __future__ import annotations

import argparse
import functools
import json
import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from benchmarks.timing import wall_net
from pallas_kernels.indexer.histogram import histogram
from pallas_kernels.indexer.topk_hist import _pick_bin

try:
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover
    plgpu = None

BINS = 2048


def step(op, x, h):
    N = x.shape[0]
    if op == "noop":
        return x + 1, h
    if op == "reduce":
        return x + (jnp.sum(x) & 1), h
    if op == "cumsum":
        return jnp.cumsum(x) & 0xFFFF, h
    if op == "hist":
        return x + 1, h + histogram(x & (BINS - 1), BINS)
    if op == "hist_sparse":
        return x + 1, h + histogram(x & (BINS - 1), BINS, mask=(x & 31) == 0)
    if op == "hist_hot":
        return x + 1, h + histogram(x & 3, BINS)
    if op == "cumsum2k":
        return x, jnp.cumsum(h) & 0xFFFF
    if op == "pick2k":
        b, below, n_in = _pick_bin(h, jnp.int32(100))
        return x, h + ((b + below + n_in) & 1)
    if op == "scan2d":
        x2 = x.reshape(N // 16, 16)
        inner = jnp.cumsum(x2, axis=1)
        rows = jnp.cumsum(jnp.sum(x2, axis=1))
        return ((inner + (rows - jnp.sum(x2, axis=1))[:, None]).reshape(N)) & 0xFFFF, h
    raise ValueError(f"unknown op {op!r}")


def kernel(x_ref, o_ref, h_ref, *, op, iters, N):
    r = pl.program_id(0)
    lanes = jax.lax.iota(jnp.int32, N)
    x = plgpu.load(x_ref.at[r, lanes])
    h = jnp.zeros((BINS,), jnp.int32) + (x_ref[r, 0] & 1)
    x, h = jax.lax.fori_loop(0, iters, lambda i, c: step(op, *c), (x, h))
    plgpu.store(o_ref.at[r, lanes], x)
    plgpu.store(h_ref.at[r, jax.lax.iota(jnp.int32, BINS)], h)


def build(op, R, N, warps):
    def make(iters):
        full = lambda shape: pl.BlockSpec(shape, lambda i: (0,) * len(shape))
        call = pl.pallas_call(
            functools.partial(kernel, op=op, iters=iters, N=N), grid=(R,), in_specs=[full((R, N))],
            out_specs=[full((R, N)), full((R, BINS))],
            out_shape=[jax.ShapeDtypeStruct((R, N), jnp.int32), jax.ShapeDtypeStruct((R, BINS), jnp.int32)],
            compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=1), name=f"probe_{op}")
        return lambda x: call(x)[0]
    return make


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--n", default="16384")
    ap.add_argument("--warps", default="16")
    ap.add_argument("--ops", default="noop,reduce,cumsum,hist,hist_sparse,hist_hot,cumsum2k,pick2k,scan2d")
    ap.add_argument("--out", default="/tmp/triton_block_ops")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    print(jax.devices(), flush=True)
    rows = []
    for N in (int(v) for v in a.n.split(",")):
        for warps in (int(v) for v in a.warps.split(",")):
            x = jax.random.randint(jax.random.key(N), (a.rows, N), 0, 1 << 20, jnp.int32)
            for op in a.ops.split(","):
                try:
                    per, _ = wall_net(build(op, a.rows, N, warps), x, n1=8, n2=136)
                    us = per * 1e6
                except Exception as e:  # noqa: BLE001 - report and go on
                    us = float("nan")
                    print(f"  {op}: {repr(e)[:300]}", flush=True)
                rows.append(dict(op=op, N=N, warps=warps, rows=a.rows, us_per_step=us))
                print(f"  R={a.rows} N={N:>6} warps={warps:>2} {op:>12}: {us:7.3f} us/step", flush=True)
    with open(os.path.join(a.out, "triton_block_ops.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
