"""ptxas resources (registers, spills, shared memory) of the Mosaic GPU attention kernel's variants, on the GPU.

    MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=DIR PYTHONPATH=. python benchmarks/mosaic_resources.py DIR

Mosaic GPU compiles a kernel when it is first called; with MOSAIC_GPU_DUMP_PTXAS set it writes ptxas' verbose log
(one file per kernel) into MOSAIC_GPU_DUMP_TO. This compiles and runs each variant once on a small CSA decode case,
then prints every "registers" / "spill" line of the logs, per variant. Why: session 9 measured the FP8 path's
dequantization at ~10x its instruction-count estimate; spills in the 224-register consumers are the first suspect.
"""

from __future__ import annotations

import glob
import os
import sys

import jax
import numpy as np

from benchmarks.sparse_attention import D, make_case
from pallas_kernels.sparse_attention.gpu_mosaic import sparse_attention_mosaic

VARIANTS = [("bf16", False, None), ("fp8_cvt", True, None), ("fp8_bits", True, "bits"), ("fp8_loop", True, "loop"),
            ("fp8_no_convert", True, "no_convert"), ("fp8_no_dequant", True, "no_dequant")]


def main(out_dir: str):
    if not os.environ.get("MOSAIC_GPU_DUMP_PTXAS") or not os.environ.get("MOSAIC_GPU_DUMP_TO"):
        raise SystemExit("set MOSAIC_GPU_DUMP_PTXAS=1 and MOSAIC_GPU_DUMP_TO=<existing dir>")
    rng = np.random.default_rng(0)
    for name, fp8, diag in VARIANTS:
        before = set(glob.glob(os.path.join(out_dir, "*")))
        q, wpool, cpool, sinks, widx, cidx = make_case(rng, "csa", 4, 1, 512, 4096, fp8, 1)
        fn = jax.jit(lambda *a, diag=diag: sparse_attention_mosaic(*a, scale=D ** -0.5, _diag=diag))
        jax.block_until_ready(fn(q, wpool, widx[0], cpool, cidx[0], sinks))
        new = sorted(set(glob.glob(os.path.join(out_dir, "*"))) - before)
        print(f"== {name}: {len(new)} new dump files", flush=True)
        for f in new:
            if os.path.isfile(f):
                with open(f, errors="replace") as fh:
                    for line in fh:
                        if any(k in line for k in ("registers", "spill", "smem", "Compiling entry")):
                            print(f"   {os.path.basename(f)}: {line.rstrip()}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.environ["MOSAIC_GPU_DUMP_TO"])
