"""SASS instructions per inline-PTX block (the Mosaic fp4 indexer's, the FP4-weight grouped matmul's), counted on a
machine without a GPU.

    python benchmarks/asm_sass_counts.py [--cuobjdump PATH]

Each block of `pallas_kernels.indexer.mosaic_fp4` is wrapped in a kernel whose inputs come from global memory and
whose outputs go back there (so ptxas can neither fold nor drop them), assembled for sm_90a with ptxas -O3, and
disassembled with cuobjdump; the count leaves out the loads, stores, moves and the exit. Needs ptxas (CUDA) and
cuobjdump (`pip download --no-deps nvidia-cuda-cuobjdump`, then unzip the wheel: `nvidia/cu13/bin/cuobjdump`).

Session 46 (ptxas 13.0): fp4 -> e5m2 10 instructions per 8 values (a packed word; 9 since session 49: one mask
for both halves), the e5m2 tables 35 per key row and thread, fp4 -> f16 22 per 8 values (precision "f16"), the f16 group factors 38 per key row and thread. A key row
is held by the 4 threads of a quad, each of which builds all 4 groups' tables, so per key: 16 x 10 = 160 for the
conversion and 4 x 35 = 140 for the tables. The H100's `convert="raw"` probe (`results/h100_s46r5_idx.log`), which
drops the conversion (and, presumably, ptxas the tables' dead outputs, all but the row factor: ~280 instructions a
key in all), took 21.0 us off 90.3 at B = 64 x 128K (f16: 29.6 off 110.3). Not measured: SASS of the whole kernel.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from pallas_kernels.grouped_matmul import fp4 as G4  # noqa: E402
from pallas_kernels.indexer import mosaic_fp4 as M4  # noqa: E402

# (name, asm, outputs, inputs): the asm's $0.. are its outputs, then its inputs
BLOCKS = [("fp4_e5m2x8", M4.FP4_E5M2X8_ASM, 2, 3), ("e5m2_luts", M4.E5M2_LUTS_ASM, 9, 1),
          ("fp4_f16x4", M4.FP4_F16X4_SCALED_ASM, 4, 2), ("scale_factors", M4.SCALE_FACTORS_ASM, 5, 1),
          ("gmm_e2m1_pairs", G4.E2M1_PAIRS_ASM, 4, 1)]   # 4 bytes -> 8 weights' bf16 bits
SKIP = ("LDG", "STG", "LDC", "ULDC", "EXIT", "BRA", "NOP", "S2R", "MOV", "IMAD.MOV")


def kernel_ptx(name, body, n_out, n_in):
    regs = "\n".join(f".reg .b32 %a{i};" for i in range(n_out + n_in))
    loads = "\n".join(f"ld.global.u32 %a{n_out + i}, [%rd1+{4 * i}];" for i in range(n_in))
    stores = "\n".join(f"st.global.u32 [%rd2+{4 * i}], %a{i};" for i in range(n_out))
    for i in reversed(range(n_out + n_in)):
        body = body.replace(f"${i}", f"%a{i}")
    return (f".visible .entry {name}(.param .u64 pin, .param .u64 pout)\n{{\n.reg .b64 %rd1, %rd2;\n{regs}\n"
            f"ld.param.u64 %rd1, [pin];\nld.param.u64 %rd2, [pout];\n{loads}\n{body}\n{stores}\nret;\n}}\n")


def count(ptxas, cuobjdump, blocks=BLOCKS):
    """-> {block name: [SASS opcodes]} (loads, stores, moves, exit left out)."""
    with tempfile.TemporaryDirectory() as d:
        src, cubin = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        with open(src, "w") as f:
            f.write(".version 8.0\n.target sm_90a\n.address_size 64\n" + "\n".join(kernel_ptx(*b) for b in blocks))
        subprocess.run([ptxas, "-arch=sm_90a", "-O3", src, "-o", cubin], check=True)
        sass = subprocess.run([cuobjdump, "-sass", cubin], check=True, capture_output=True, text=True).stdout
    ops, cur = {}, None
    for line in sass.splitlines():
        m = re.search(r"Function : (\w+)", line)
        if m:
            cur = ops.setdefault(m.group(1), [])
            continue
        m = re.match(r"\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", line)
        if m and cur is not None and not m.group(1).startswith(SKIP):
            cur.append(m.group(1))
    return ops


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ptxas", default=os.environ.get("PTXAS") or shutil.which("ptxas"))
    p.add_argument("--cuobjdump", default=shutil.which("cuobjdump"))
    a = p.parse_args(argv)
    if not (a.ptxas and a.cuobjdump):
        p.error("needs ptxas and cuobjdump (see the module doc)")
    for name, ops in count(a.ptxas, a.cuobjdump).items():
        print(f"{name:>14} {len(ops):>3}  {' '.join(ops)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
