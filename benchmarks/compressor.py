"""Benchmark of the fused compressor chunk update (Pallas GPU kernel vs the XLA reference), V4-Flash shapes.

    PYTHONPATH=. python benchmarks/compressor.py --out DIR [--quick] [--variants] [--cases decode|prefill|NAME,...]

Compressors: main CSA (ratio 4, overlap, d = 512, bf16 entries), main HCA (ratio 128, d = 512, bf16 entries),
indexer (ratio 4, overlap, d = 128, fp4 rotated / fp8 rotated entries). Decode: batch 64, S = 1, every row closing
a window (the worst case: one entry written per row). Prefill: batch 1, S = 8192 from position 0, and the
--prefill shapes (default also 4 x 16384: a floor of 60-150 us, which the chain's ~10 us harness cannot dominate).
Per case: time per call as dependent calls in one jitted lax.scan (call i + 1's `start` depends, through a scalar
float add, on call i's written entries and new state, so nothing is hoisted and no array is copied for it), the
floor = bytes / copy BW with bytes = kv + gate read + state read / written + entries written (the FLOPs,
~10 per input element, are negligible), ratio to it, and the XLA reference in the same run. The "harness" column
is the chain's own iteration (the carry update, no compressor): every other column includes it. --unroll N runs N
dependent calls per scan iteration (the H200 harness measured 10-13 us per iteration with N = 1, session 5).
--variants also times kernel configurations of the pallas path (VARIANTS: block sizes, layouts, warps, stages;
each on top of `default_config`), one json key / column per variant ("v:<name>_us"); --cases picks a subset.
--kernels lists, per pallas configuration, the kernels one call launches and their CUPTI times (the two passes of
the two-pass layout, any XLA kernel around them), so a gap to the floor can be placed in a pass.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.indexer import floor_s
from benchmarks.timing import cupti_kernels, measure_ceilings, timed_chain
from pallas_kernels.compressor import compress_chunk
from pallas_kernels.compressor.gpu import default_config
from pallas_kernels.indexer import formats as F

INV_FREQ = tuple(1.0 / (10000.0 ** (np.arange(0, 64, 2) / 64)))
COMPRESSORS = {  # name: (ratio, overlap, d, key_format, rotate, entry bytes)
    "csa_main": (4, True, 512, None, False, 1024),
    "hca_main": (128, False, 512, None, False, 1024),
    "idx_fp4": (4, True, 128, "fp4", True, 68),
    "idx_fp8": (4, True, 128, "fp8", True, 132),
}
# kernel options on top of default_config, per ratio class (name: options)
VARIANTS_SMALL = {
    "f_wb1": dict(two_pass=False, windows_per_block=1),
    "f_wb2": dict(two_pass=False, windows_per_block=2),
    "f_wb4": dict(two_pass=False, windows_per_block=4),
    "f_wb8": dict(two_pass=False, windows_per_block=8),
    "f_wb16": dict(two_pass=False, windows_per_block=16),
    "f_wb8_w8": dict(two_pass=False, windows_per_block=8, num_warps=8),
    "2p_wb2": dict(two_pass=True, windows_per_block=2),
    "2p_wb8": dict(two_pass=True, windows_per_block=8),
    "2p_wb16": dict(two_pass=True, windows_per_block=16),
    "2p_wb32": dict(two_pass=True, windows_per_block=32),
    "2p_wb16_w4": dict(two_pass=True, windows_per_block=16, num_warps=4),
    "2p_wb32_dc32": dict(two_pass=True, windows_per_block=32, dc=32),
    "2p_wb8_dc32": dict(two_pass=True, windows_per_block=8, dc=32),
    "2p_wb16_dc32": dict(two_pass=True, windows_per_block=16, dc=32),
    "2p_wb64_dc32": dict(two_pass=True, windows_per_block=64, dc=32),
    "2p_wb32_dc16": dict(two_pass=True, windows_per_block=32, dc=16),
    "2p_wb64_dc16": dict(two_pass=True, windows_per_block=64, dc=16),
    "f_wb8_dc32": dict(two_pass=False, windows_per_block=8, dc=32),
    "f_wb16_dc32": dict(two_pass=False, windows_per_block=16, dc=32),
    "f_wb32_dc32": dict(two_pass=False, windows_per_block=32, dc=32),
    "2p_wb4_dc32": dict(two_pass=True, windows_per_block=4, dc=32),
    "2p_wb8_dc32_w2": dict(two_pass=True, windows_per_block=8, dc=32, num_warps=2),
    "2p_wb8_dc32_w8": dict(two_pass=True, windows_per_block=8, dc=32, num_warps=8),
    "2p_wb8_dc32_fw2": dict(two_pass=True, windows_per_block=8, dc=32, finish_num_warps=2),
    "2p_wb8_dc32_fw8": dict(two_pass=True, windows_per_block=8, dc=32, finish_num_warps=8),
    "nofuse": dict(fuse_state=False),
    "2p_wb8_dc32_scr32": dict(two_pass=True, windows_per_block=8, dc=32, scratch_dtype="float32"),  # session 11-14
    # pass 2 (finish) with its own window blocks / channel chunks (session 15)
    "2p_wb8_dc32_f16": dict(two_pass=True, windows_per_block=8, dc=32, finish_windows_per_block=16),
    "2p_wb8_dc32_f32": dict(two_pass=True, windows_per_block=8, dc=32, finish_windows_per_block=32),
    "2p_wb8_dc32_f64": dict(two_pass=True, windows_per_block=8, dc=32, finish_windows_per_block=64),
    "2p_wb8_dc32_fdc64": dict(two_pass=True, windows_per_block=8, dc=32, finish_dc=64),
    "2p_wb8_dc32_f32_fdc64": dict(two_pass=True, windows_per_block=8, dc=32, finish_windows_per_block=32,
                                  finish_dc=64),
    "2p_wb8_dc32_f4": dict(two_pass=True, windows_per_block=8, dc=32, finish_windows_per_block=4),
}
VARIANTS_ROT = {"dot": dict(mix="dot")}
VARIANTS_LARGE = {
    "2p_sb16": dict(two_pass=True, slot_block=16),
    "2p_sb32": dict(two_pass=True, slot_block=32),
    "2p_sb64": dict(two_pass=True, slot_block=64),
    "2p_sb128": dict(two_pass=True, slot_block=128, num_warps=8),
    "2p_sb32_dc32": dict(two_pass=True, slot_block=32, dc=32),
    "2p_sb32_st1": dict(two_pass=True, slot_block=32, num_stages=1),
    "2p_sb32_st3": dict(two_pass=True, slot_block=32, num_stages=3),
    "2p_sb32_w8": dict(two_pass=True, slot_block=32, num_warps=8),
    "f_sb32": dict(two_pass=False, windows_per_block=1, slot_block=32),
    "f_sb32_wb2": dict(two_pass=False, windows_per_block=2, slot_block=32),
    "nofuse": dict(fuse_state=False),
}


def variants_for(name):
    r, _, _, _, rotate, _ = COMPRESSORS[name]
    if r > 16:
        return VARIANTS_LARGE
    return {**VARIANTS_SMALL, **(VARIANTS_ROT if rotate else {})}


def case(name, B, S, ceil, n_iter, with_variants=False, unroll=1, only=None, kernels=False):
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
    row = dict(name=name, B=B, S=S, floor_us=fl * 1e6, bytes=bytes_, unroll=unroll,
               default_config=default_config(B, S, r, d, overlap, fmt))
    # "harness": the chain's own iteration without a compressor call, included in every other column
    runs = [("harness", None, {}), ("pallas", "pallas", {}), ("reference", "reference", {})]
    if with_variants:
        runs += [("v:" + k, "pallas", opts) for k, opts in variants_for(name).items() if not only or k in only]
    for key, impl, opts in runs:
        def step(carry, kv, gate, skv, sg, pk, pg, impl=impl, opts=opts):
            st, ent = carry
            if impl is None:
                dep = jax.tree_util.tree_leaves(ent)[0][0, 0, 0].astype(jnp.float32)
                return (st.astype(jnp.float32) + 0.0 * dep).astype(jnp.int32), ent
            out = compress_chunk(kv, gate, st, nv, skv, sg, pk, pg, ent, impl=impl, **kw, **opts)
            leaf = jax.tree_util.tree_leaves(out[0])[0]
            dep = leaf[0, 0, 0].astype(jnp.float32) + out[1][0, 0, 0]
            return (st.astype(jnp.float32) + 0.0 * dep).astype(jnp.int32), out[0]
        try:
            row[key + "_us"] = timed_chain(step, (start, entries), n_iter, unroll=unroll,
                                           args=(kv, gate, skv, sg, pk, pg)) * 1e6
        except Exception as e:  # noqa: BLE001
            row[key + "_us"] = float("nan")
            row[key + "_err"] = repr(e)[:300]
        if kernels and impl == "pallas":   # which kernels the call is made of, and each one's time
            def one(kv, gate, st, skv, sg, pk, pg, ent, opts=opts):
                return compress_chunk(kv, gate, st, nv, skv, sg, pk, pg, ent, impl="pallas", **kw, **opts)
            try:
                row[key + "_kernels"] = cupti_kernels(jax.jit(one), kv, gate, start, skv, sg, pk, pg, entries)
            except Exception as e:  # noqa: BLE001
                row[key + "_kernels_err"] = repr(e)[:300]
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/comp_bench")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--variants", action="store_true", help="also time the kernel configurations of VARIANTS_*")
    ap.add_argument("--cases", default="",
                    help="comma-separated: decode and / or prefill, and / or compressor names (default all)")
    ap.add_argument("--only-variants", default="", help="with --variants: time only these (comma-separated)")
    ap.add_argument("--prefill", default="1x8192,4x16384", help="prefill shapes BxS, comma-separated")
    ap.add_argument("--kernels", action="store_true",
                    help="also list (CUPTI) the kernels one call of each pallas configuration launches, with times")
    ap.add_argument("--unroll", type=int, default=1,
                    help="dependent calls per scan iteration (timing.timed_chain): > 1 shares the loop's own "
                         "per-iteration cost (part of the 'harness' column) among that many calls")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    ceil = measure_ceilings(a.quick)
    print(f"ceilings: copy {ceil['copy_Bps'] / 1e12:.2f} TB/s, bf16 {ceil['bf16_flops'] / 1e12:.0f} TFLOP/s", flush=True)
    names = list(COMPRESSORS)
    sel = [c for c in a.cases.split(",") if c]
    shapes = [tuple(int(x) for x in bs.split("x")) for bs in a.prefill.split(",") if bs]
    cases = [(n, 64, 1) for n in names] + [(n, B, S) for B, S in shapes for n in names]
    sel_names = [c for c in sel if c in COMPRESSORS]
    sel_kinds = [c for c in sel if c in ("decode", "prefill")]
    if set(sel) - set(sel_names) - set(sel_kinds):
        raise SystemExit(f"unknown --cases {sorted(set(sel) - set(sel_names) - set(sel_kinds))}")
    cases = [(n, B, S) for n, B, S in cases if (not sel_names or n in sel_names)
             and (not sel_kinds or ("decode" if S == 1 else "prefill") in sel_kinds)]
    print(f"{'compressor':>10} {'B':>3} {'S':>5} {'floor':>9} {'harness':>17} {'pallas':>17} {'xla_ref':>17}",
          flush=True)
    rows = []
    for n, B, S in cases:
        # enough dependent calls per timed program that its one dispatch (100-250 us) adds < ~1-2 us per call
        r = case(n, B, S, ceil, 200 if S == 1 else 100, a.variants, a.unroll,
                 [v for v in a.only_variants.split(",") if v], a.kernels)
        rows.append(r)
        cells = " ".join(f"{r[k]:9.1f} ({r[k] / r['floor_us']:5.1f}x)" for k in ("harness_us", "pallas_us", "reference_us"))
        print(f"{n:>10} {B:>3} {S:>5} {r['floor_us']:8.2f}u {cells}", flush=True)
        if a.variants:
            print(f"{'':>10}   default {r['default_config']}", flush=True)
            for k in r:
                if k.startswith("v:") and k.endswith("_us"):
                    print(f"{'':>10}   {k[2:-3]:>14} {r[k]:9.1f} ({r[k] / r['floor_us']:5.1f}x)", flush=True)
        for k in r:
            if k.endswith("_kernels"):
                print(f"{'':>10}   kernels of {k[:-8]}: " + ", ".join(f"{nm[:40]} {us:.1f}" for nm, us in r[k]),
                      flush=True)
        for k in r:
            if k.endswith("_err"):
                print("   ", k, r[k], flush=True)
        with open(os.path.join(a.out, "compressor_bench.json"), "w") as fh:   # after every case (time limits)
            json.dump(dict(ceilings=ceil, rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
