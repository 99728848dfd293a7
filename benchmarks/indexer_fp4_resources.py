"""Registers and spills of the Mosaic indexer kernel over fp4 keys, per precision, on the GPU.

    MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=DIR PYTHONPATH=. \
        python benchmarks/indexer_fp4_resources.py DIR [--batch 64] [--keys 32768]
    PYTHONPATH=. python benchmarks/indexer_fp4_resources.py --offline DIR      # no GPU: benchmarks/mosaic_offline.py

Mosaic GPU compiles a kernel when it is first called; with the dump variables set it writes ptxas' verbose log (and
its MLIR and PTX) of each kernel into DIR. This compiles and runs the fp4 scores kernel once per precision ("fp8",
the default, and "f16"), alone and under the segment top-k (the decode default), and prints per kernel its dump
files (name, size), the ptxas resource lines and the CTA's shared memory. Why (session 48): the fp4 path runs at 2.35x its byte floor on the H200 (B = 64
x 128K context), and an SM holds as many of its CTAs as their registers and shared memory allow.

Session 48 (H100, `results/h100_s48r1_fp4res.log`): 134 registers (scores alone) and 136 (under the segment top-k)
at precision "fp8", no spills; the segment top-k's CTA takes 81952 B of shared memory, so 2 CTAs an SM.
Session 49 added the converter warpgroup's kernels (`fp4_converter` 1 and 2; 256 threads a CTA, so 2 CTAs an SM need
<= 128 registers a thread).

--offline (session 50) lowers each kernel on this machine and compiles it with jax's CUDA plugin against a stand-in
driver (`benchmarks/mosaic_offline.py`: run its `fetch` once): the same ptxas lines, plus threads, shared memory and
CTAs an SM per kernel, with no GPU and no key data (the inputs are shapes only).
"""

from __future__ import annotations

import argparse
import glob
import os
import re

import jax
import jax.numpy as jnp
import numpy as np


def _report(paths):
    for f in paths:
        if not os.path.isfile(f):
            continue
        with open(f, errors="replace") as fh:
            text = fh.read()
        name = os.path.basename(f)
        print(f"   {name}: {len(text)} bytes")
        if name.endswith(".ptxas"):
            for line in text.splitlines():
                if any(k in line for k in ("registers", "spill")):
                    print(f"   {name}: {line.strip()}")
        smem = sorted(set(re.findall(r"mosaic_gpu\.smem_bytes = (\d+)", text)))
        if smem:
            print(f"   {name}: shared memory {', '.join(smem)} B a CTA")


def _issue_model(sass_path, B, T, block_t=128, sms=132, clock_ghz=1.98):
    """Per key block and SM sub-partition: the SASS the scoring loop and the converter loop issue (one warp of
    each per sub-partition and CTA), and the time that many issue cycles take for all B x T / block_t blocks at
    one warp instruction a cycle (`sass_loops.block_loops`; the H100 SXM / H200 boost clock)."""
    from benchmarks.sass_loops import block_loops, parse

    found = block_loops(*parse(open(sass_path).read()))
    per_block = {k: len(lp.body) for k, lp in found.items() if lp is not None}
    total = sum(per_block.values())
    blocks_per_sm = B * T / block_t / sms
    us = total * blocks_per_sm / (clock_ghz * 1e3)
    parts = ", ".join(f"{k} {n}" for k, n in per_block.items())
    return (f"SASS a block and sub-partition: {parts} = {total}; issue floor {us:.1f} us at B = {B} x {T} keys "
            f"({blocks_per_sm:.0f} blocks an SM, {clock_ghz} GHz)")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", nargs="?", default=os.environ.get("MOSAIC_GPU_DUMP_TO"))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--keys", type=int, default=32768, help="compressed keys a row (128K context / 4)")
    ap.add_argument("--offline", action="store_true", help="compile on this machine (no GPU): mosaic_offline.py")
    args = ap.parse_args()
    offline = None
    if args.offline:
        if not args.out_dir:
            raise SystemExit("--offline needs DIR (where the ptxas logs, PTX and cubins go)")
        from benchmarks.mosaic_offline import OfflineMosaic

        offline = OfflineMosaic(args.out_dir)
        print(f"offline: {offline.ptxas_version.splitlines()[-1]} (cuda root {offline.cuda_root})", flush=True)
    elif not os.environ.get("MOSAIC_GPU_DUMP_TO") or not args.out_dir:
        raise SystemExit("set MOSAIC_GPU_DUMP_PTXAS=1 and MOSAIC_GPU_DUMP_TO=<existing dir>, or pass --offline DIR")
    from pallas_kernels.indexer import formats as F
    from pallas_kernels.indexer.gpu import indexer_topk_gpu
    from pallas_kernels.indexer.gpu_mosaic import indexer_scores_mosaic

    rng = np.random.default_rng(0)
    B, T, H = args.batch, args.keys, 64
    if offline:   # lowering needs shapes only
        q = jax.ShapeDtypeStruct((B, 1, H, 128), jnp.float32)
        w = jax.ShapeDtypeStruct((B, 1, H), jnp.float32)
        keys = jax.eval_shape(lambda k: F.quantize(k, "fp4"), jax.ShapeDtypeStruct((B, T, 128), jnp.float32))
        nv = jax.ShapeDtypeStruct((B, 1), jnp.int32)
    else:
        q = jnp.asarray(rng.standard_normal((B, 1, H, 128)), jnp.float32)
        w = jnp.asarray(rng.standard_normal((B, 1, H)), jnp.float32)
        keys = F.quantize(jnp.asarray(rng.standard_normal((B, T, 128)), jnp.float32), "fp4")
        nv = jnp.full((B, 1), T, jnp.int32)
    from pallas_kernels.indexer import gpu_mosaic

    # (precision, fp4_converter slots): the register path at both precisions, and session 49's converter warpgroup
    # (session 50: "rows" = fp4_layout "rows", a thread a key row, with fp4_tables "registers")
    for precision, conv, tables in (("fp8", 0, "registers"), ("fp8", 2, "registers"), ("fp8", 2, "shared"),
                                    ("fp8", 1, "registers"), ("fp8", 2, "rows"), ("fp8", 1, "rows"),
                                    ("f16", 0, "registers")):
        for what in ("scores", "segment_set"):
            before = set(glob.glob(os.path.join(args.out_dir, "*")))
            if what == "scores":
                fn = jax.jit(lambda *a, p=precision, c=conv: indexer_scores_mosaic(*a, precision=p, fp4_converter=c))
            else:
                fn = jax.jit(lambda *a, p=precision: indexer_topk_gpu(*a, k=512, kernel="mosaic", topk="segment_set",
                                                                      precision=p))
            saved = dict(gpu_mosaic.MOSAIC_CONFIG)
            gpu_mosaic.MOSAIC_CONFIG.update(fp4_converter=conv, fp4_tables="registers" if tables == "rows" else tables,
                                            fp4_layout="rows" if tables == "rows" else "fragments")
            layout = "fp4_layout=rows" if tables == "rows" else f"fp4_tables={tables}"
            label = f"== precision={precision} fp4_converter={conv} {layout} {what}"
            try:
                if offline:
                    for r in offline.compile_jitted(fn, q, w, keys, nv):
                        print(f"{label}: {r.line()}", flush=True)
                        if r.sass_path:
                            print(f"{label}: {_issue_model(r.sass_path, B, T)}", flush=True)
                    continue
                jax.block_until_ready(fn(q, w, keys, nv))
            except Exception as e:   # one variant that fails to compile must not hide the others' numbers
                print(f"{label}: FAILED "
                      f"{type(e).__name__}: {e}"[:2000], flush=True)
                continue
            finally:
                gpu_mosaic.MOSAIC_CONFIG.update(saved)
            new = sorted(set(glob.glob(os.path.join(args.out_dir, "*"))) - before)
            print(f"{label}: {len(new)} new dump files", flush=True)
            _report(new)


if __name__ == "__main__":
    main()
