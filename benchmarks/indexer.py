"""Benchmark of the lightning-indexer top-k (Pallas GPU scores kernel + top-k vs the XLA reference), V4-Flash shapes
(64 index heads x 128, index_topk 512).

    PYTHONPATH=. python benchmarks/indexer.py --out DIR [--quick]

Decode: one query per sequence against its whole key cache at 8K / 128K / 1M context (T = ctx / 4 compressed keys),
batch 1 and 64, key formats bf16 / fp8 (132 B) / fp4 (68 B). Prefill: a 1024-query chunk at 128K context (bf16 & fp4).
Per case: time per call (us) as dependent calls inside one jitted lax.scan (q_{i+1} depends on picks_i), the floor
max(bytes / copy BW, FLOPs / bf16 rate) with bytes = keys read once + q read + picks written and FLOPs = 2*H*dI per
(query, visible key), the ratio to it, and the XLA reference in the same run. Variants: pallas+lax.top_k,
pallas+blockwise top-k, scores kernel alone (top-k stage cost = difference).
Note: caches smaller than L2 (8K context, batch 1) are re-read from L2 across iterations.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp

from benchmarks.timing import measure_ceilings, timed_chain
from pallas_kernels.indexer import formats as F, indexer_scores_pallas, indexer_topk

H, D, TOPK = 64, 128, 512

# ---- timing / ceiling helpers: benchmarks/timing.py


def floor_s(bytes_, flops, ceil):
    return max(bytes_ / ceil["copy_Bps"], flops / ceil["bf16_flops"])


def case(B, S, ctx, fmt, ceil, n_iter, variants):
    T = ctx // 4
    key = jax.random.key(B * 7 + T + S)
    k1, k2, k3 = jax.random.split(key, 3)
    q = jax.random.normal(k1, (B, S, H, D), jnp.float32)
    if fmt in ("fp8", "fp4"):
        q = F.fake_quantize(q, fmt)
    w = jax.random.normal(k2, (B, S, H), jnp.float32) * (H ** -0.5 * D ** -0.5)
    keys = F.quantize(jax.random.normal(k3, (B, T, D), jnp.float32), fmt)
    if S == 1:
        nv = jnp.full((B, 1), T, jnp.int32)
    else:  # the chunk's last S queries of a ctx-token prefix: causal
        nv = ((ctx - S + jnp.arange(S, dtype=jnp.int32) + 1) // 4)[None, :].repeat(B, 0)
    visible = float(jnp.sum(jnp.minimum(nv, T)))
    bytes_ = B * T * F.BYTES_PER_KEY[fmt](D) + q.size * 4 + w.size * 4 + B * S * min(TOPK, T) * 4
    flops = 2 * H * D * visible
    fl = floor_s(bytes_, flops, ceil)
    row = dict(B=B, S=S, ctx=ctx, fmt=fmt, floor_us=fl * 1e6, bytes=bytes_, flops=flops)
    for name, fn in variants.items():
        def step(c, fn=fn):
            qq, acc = c
            out = fn(qq, w, keys, nv)
            dep = (jnp.sum(out[..., :1]) if out.dtype == jnp.int32 else jnp.max(out[..., :1])).astype(jnp.float32)
            return qq + 0.0 * dep, acc + dep
        try:
            t = timed_chain(step, (q, jnp.zeros((), jnp.float32)), n_iter)
            row[name + "_us"] = t * 1e6
        except Exception as e:  # noqa: BLE001 - report and continue (e.g. reference OOM)
            row[name + "_us"] = float("nan")
            row[name + "_err"] = repr(e)[:200]
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/idx_bench")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    ceil = measure_ceilings(a.quick)
    print(f"ceilings: copy {ceil['copy_Bps'] / 1e12:.2f} TB/s, bf16 {ceil['bf16_flops'] / 1e12:.0f} TFLOP/s", flush=True)
    variants = {
        "pallas": lambda q, w, k, n: indexer_topk(q, w, k, n, k=TOPK, impl="pallas"),
        "pallas_blockwise": lambda q, w, k, n: indexer_topk(q, w, k, n, k=TOPK, impl="pallas", topk="blockwise"),
        "scores_only": lambda q, w, k, n: indexer_scores_pallas(q, w, k, n, impl="pallas"),
        "xla_ref": lambda q, w, k, n: indexer_topk(q, w, k, n, k=TOPK, impl="reference"),
    }
    cases = []
    fmts = ("bf16", "fp8", "fp4")
    if a.quick:
        cases = [(1, 1, 131072, f) for f in fmts] + [(64, 1, 1 << 20, f) for f in ("fp8", "fp4")]
        cases += [(1, 1024, 131072, "fp4")]
    else:
        for ctx in (8192, 131072, 1 << 20):
            for B in (1, 64):
                for f in fmts:
                    cases.append((B, 1, ctx, f))
        cases += [(1, 1024, 131072, "bf16"), (1, 1024, 131072, "fp4")]
    rows = []
    hdr = f"{'B':>3} {'S':>5} {'ctx':>8} {'fmt':>5} {'floor':>9} " + " ".join(f"{v:>17}" for v in variants)
    print(hdr, flush=True)
    for B, S, ctx, f in cases:
        n_iter = 20 if B * ctx * S <= (1 << 24) else 5
        r = case(B, S, ctx, f, ceil, n_iter, variants)
        rows.append(r)
        cells = " ".join(f"{r[v + '_us']:9.1f} ({r[v + '_us'] / r['floor_us']:5.1f}x)" for v in variants)
        print(f"{B:>3} {S:>5} {ctx:>8} {f:>5} {r['floor_us']:8.1f}u {cells}", flush=True)
    with open(os.path.join(a.out, "indexer_bench.json"), "w") as fh:
        json.dump(dict(ceilings=ceil, rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
