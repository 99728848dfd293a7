"""Benchmark of the fused compressor chunk update (Pallas GPU kernel vs the XLA reference), V4-Flash shapes.

    PYTHONPATH=. python benchmarks/compressor.py --out DIR [--quick]

Compressors: main CSA (ratio 4, overlap, d = 512, bf16 entries), main HCA (ratio 128, d = 512, bf16 entries),
indexer (ratio 4, overlap, d = 128, fp4 rotated / fp8 rotated entries). Decode: batch 64, S = 1, every row closing
a window (the worst case: one entry written per row). Prefill: batch 1, S = 8192 from position 0.
Per case: time per call as dependent calls in one jitted lax.scan (kv_{i+1} depends on the written entries), the
floor = bytes / copy BW with bytes = kv + gate read + state read / written + entries written (the FLOPs,
~10 per input element, are negligible), ratio to it, and the XLA reference in the same run.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.indexer import floor_s
from benchmarks.timing import measure_ceilings, timed_chain
from pallas_kernels.compressor import compress_chunk
from pallas_kernels.indexer import formats as F

INV_FREQ = tuple(1.0 / (10000.0 ** (np.arange(0, 64, 2) / 64)))
COMPRESSORS = {  # name: (ratio, overlap, d, key_format, rotate, entry bytes)
    "csa_main": (4, True, 512, None, False, 1024),
    "hca_main": (128, False, 512, None, False, 1024),
    "idx_fp4": (4, True, 128, "fp4", True, 68),
    "idx_fp8": (4, True, 128, "fp8", True, 132),
}


def case(name, B, S, ceil, n_iter):
    r, overlap, d, fmt, rotate, ebytes = COMPRESSORS[name]
    c = 2 if overlap else 1
    ks = jax.random.split(jax.random.key(hash((name, B, S)) % 1000), 6)
    kv = jax.random.normal(ks[0], (B, S, c * d), jnp.float32)
    gate = jax.random.normal(ks[1], (B, S, c * d), jnp.float32)
    skv = jax.random.normal(ks[2], (B, r, c * d), jnp.float32)
    sg = jax.random.normal(ks[3], (B, r, c * d), jnp.float32)
    pk = pg = None
    if overlap:
        pk = jax.random.normal(ks[4], (B, r, d), jnp.float32)
        pg = jax.random.normal(ks[5], (B, r, d), jnp.float32)
    if S == 1:
        start = jnp.full((B,), 5 * r - 1, jnp.int32)    # every row closes window 4
        cap = 8192
    else:
        start = jnp.zeros((B,), jnp.int32)
        cap = S // r + 1
    nv = jnp.full((B,), S, jnp.int32)
    entries = F.quantize(jnp.zeros((B, cap, d), jnp.float32), fmt, jnp.bfloat16)
    kw = dict(ratio=r, overlap=overlap, norm_weight=jnp.ones((d,), jnp.float32), eps=1e-6, inv_freq=INV_FREQ,
              norm_dtype=jnp.bfloat16, key_format=fmt, rotate=rotate)
    n_entries = B * (S // r) if S > 1 else B
    bytes_ = 2 * kv.size * 4 + 2 * (skv.size + sg.size) * 4 + (2 * 2 * pk.size * 4 if overlap else 0) \
        + n_entries * ebytes
    fl = floor_s(bytes_, 0, ceil)
    row = dict(name=name, B=B, S=S, floor_us=fl * 1e6, bytes=bytes_)
    for impl in ("pallas", "reference"):
        def step(carry, impl=impl):
            kv_, ent = carry
            out = compress_chunk(kv_, gate, start, nv, skv, sg, pk, pg, ent, impl=impl, **kw)
            leaf = jax.tree_util.tree_leaves(out[0])[0]
            dep = leaf[0, 0, 0].astype(jnp.float32) + out[1][0, 0, 0]
            return kv_ + 0.0 * dep, out[0]
        try:
            row[impl + "_us"] = timed_chain(step, (kv, entries), n_iter) * 1e6
        except Exception as e:  # noqa: BLE001
            row[impl + "_us"] = float("nan")
            row[impl + "_err"] = repr(e)[:300]
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/comp_bench")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    ceil = measure_ceilings(a.quick)
    print(f"ceilings: copy {ceil['copy_Bps'] / 1e12:.2f} TB/s, bf16 {ceil['bf16_flops'] / 1e12:.0f} TFLOP/s", flush=True)
    names = list(COMPRESSORS)
    cases = [(n, 64, 1) for n in names] + [(n, 1, 8192) for n in names]
    print(f"{'compressor':>10} {'B':>3} {'S':>5} {'floor':>9} {'pallas':>17} {'xla_ref':>17}", flush=True)
    rows = []
    for n, B, S in cases:
        r = case(n, B, S, ceil, 50 if S == 1 else 10)
        rows.append(r)
        cells = " ".join(f"{r[k]:9.1f} ({r[k] / r['floor_us']:5.1f}x)" for k in ("pallas_us", "reference_us"))
        print(f"{n:>10} {B:>3} {S:>5} {r['floor_us']:8.2f}u {cells}", flush=True)
        for k in ("pallas_err", "reference_err"):
            if k in r:
                print("   ", k, r[k], flush=True)
    with open(os.path.join(a.out, "compressor_bench.json"), "w") as fh:
        json.dump(dict(ceilings=ceil, rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
