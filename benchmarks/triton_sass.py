"""SASS of the Pallas (Triton backend) grouped-matmul kernels, compiled for sm_90a on a machine without a GPU: the
whole kernel's instruction count and the main K loop's, with an opcode histogram and instructions per weight.

    python3 -m venv /tmp/tvenv && /tmp/tvenv/bin/pip install triton       # once; NOT into the project's .venv
    . .venv/bin/activate && PYTHONPATH=.:tests python benchmarks/triton_sass.py [--tvenv /tmp/tvenv]
        [--decodes join,f32,join_t] [--options block_n=256,...] [--no-bf16] [--keep DIR]
        [--M 96 --K 4096 --N 2048 --E 256]

How: each kernel (`fp4.grouped_matmul_fp4_gpu` per decode, `gpu.grouped_matmul_gpu` with bf16 weights) is lowered
for "cuda" on the CPU (jax falls back to compute capability 9.0), with Pallas's `lower_jaxpr_to_triton_module`
wrapped to keep the Triton module (TTIR) that it otherwise serializes into the custom call's `ir` attribute;
num_warps / num_stages are read from that call's backend_config. The TTIR text is compiled by the pip `triton`
package of the second venv (this script re-run there with --compile, in a subprocess): `triton.compile(ttir,
target=GPUTarget("cuda", 90, 32), options=num_warps/num_stages)`, which runs ttir -> ttgir -> llir -> ptx -> cubin
with triton's bundled ptxas (no GPU needed), and the cubin is disassembled by triton's bundled cuobjdump. The main
loop is the span of the backward branch (`@P0 BRA <earlier address>`) that contains HMMA/WGMMA instructions; a
block_m x block_n tile program runs it K / block_k times, each time over block_k x block_n weights, so
"per weight" = loop instructions x 32 x num_warps threads / (block_k x block_n).

Limits: the counts are indicative. The pip triton (3.9.0 when written, ptxas 13.1) is not the Triton inside the
GPU machine's jaxlib (jax 0.11.2 there) nor its ptxas, so the pipelining, layouts and scheduling may differ; the
kernel is lowered by this machine's jax (0.10.2) with compute capability 9.0 assumed. (An `elementwise_inline_asm`
with a uint32 result gets an unsigned `ui32` tensor type that Triton's verifier refuses: `fp4.e2m1_pairs` returns
int32 for that reason.) Static counts only: nothing about stalls, issue rates or memory; the registers a thread and
shared memory a program (`cuobjdump -res-usage`) give the programs an SM can hold (H100 / H200: 64K registers, 227 KB
of shared memory), not how busy they keep it.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def compile_ttir(path, num_warps, num_stages, out_cubin):
    import triton
    from triton.backends.compiler import GPUTarget
    k = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": num_warps, "num_stages": num_stages})
    with open(out_cubin, "wb") as f:
        f.write(k.asm["cubin"])
    with open(out_cubin[:-len(".cubin")] + ".ptx", "w") as f:
        f.write(k.asm["ptx"])
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    print(json.dumps(dict(triton=triton.__version__, shared=k.metadata.shared,
                          cuobjdump=os.path.join(tools, "cuobjdump"))))


# ---- run in the project venv: lower, extract TTIR, analyze SASS --------------------------------------------------

def lower_ttir(kind, M, K, N, E, options=None):
    """-> (kernel name, TTIR text, num_warps, num_stages, notes) of one kernel at these shapes."""
    sys.path.insert(0, ROOT)
    import jax
    import jax.numpy as jnp
    from jax._src.pallas.triton import pallas_call_registration as reg
    from pallas_kernels.grouped_matmul import fp4 as F, gpu as G

    captured = []
    orig = reg.lowering.lower_jaxpr_to_triton_module

    def keep(*a, **k):
        r = orig(*a, **k)
        captured.append(r)
        return r

    sds = jax.ShapeDtypeStruct
    x, gs = sds((M, K), jnp.bfloat16), sds((E,), jnp.int32)
    reg.lowering.lower_jaxpr_to_triton_module = keep
    try:
        if kind == "bf16":
            f = jax.jit(lambda x, r, g: G.grouped_matmul_gpu(x, r, g))
            rhs = sds((E, K, N), jnp.bfloat16)
        else:
            f = jax.jit(lambda x, r, g: F.grouped_matmul_fp4_gpu(x, r, g, decode=kind, **(options or {})))
            rhs = F.Fp4Weights(sds((E, N, K // 2), jnp.uint8), sds((E, N, K // F.CHUNK), jnp.uint8))
        text = f.trace(x, rhs, gs).lower(lowering_platforms=("cuda",)).as_text()
    finally:
        reg.lowering.lower_jaxpr_to_triton_module = orig
    assert len(captured) == 1, f"{kind}: expected one Triton kernel, got {len(captured)}"
    nw = int(re.search(r"num_warps = (\d+)", text).group(1))
    ns = int(re.search(r"num_stages = (\d+)", text).group(1))
    op = captured[0].module.operation
    ttir = op.get_asm(enable_debug_info=False)
    name = op.attributes["sym_name"].value
    return name, ttir, nw, ns, []


LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def parse_sass(text):
    """cuobjdump -sass text -> [(address, predicate, opcode, operands)]."""
    out = []
    for line in text.splitlines():
        m = LINE.match(line)
        if m:
            out.append((int(m.group(1), 16), (m.group(2) or "").strip(), m.group(3), m.group(4).strip()))
    return out


def main_loop(instrs):
    """The innermost backward-branch span that holds MMA instructions (HMMA / HGMMA): [start, end] addresses."""
    loops = []
    for addr, _, op, args in instrs:
        if op.startswith("BRA"):
            m = re.match(r"`?\(?(0x[0-9a-f]+)", args)
            if m and int(m.group(1), 16) < addr:
                loops.append((int(m.group(1), 16), addr))
    mma = [a for a, _, op, _ in instrs if op.split(".")[0] in ("HMMA", "HGMMA")]
    with_mma = [lp for lp in loops if any(lp[0] <= a <= lp[1] for a in mma)]
    if not with_mma:
        return None, loops
    # innermost: no other MMA loop strictly inside it
    inner = [lp for lp in with_mma if not any(o != lp and lp[0] <= o[0] and o[1] <= lp[1] for o in with_mma)]
    return max(inner, key=lambda lp: lp[1] - lp[0]), loops


CLASSES = [("MMA", ("HMMA", "HGMMA")), ("global/async loads", ("LDG", "LDGSTS", "LDGDEPBAR", "DEPBAR")),
           ("shared loads", ("LDS", "LDSM")), ("shared stores", ("STS",)),
           ("int/bit ALU", ("PRMT", "LOP3", "SHF", "IMAD", "IADD3", "LEA", "ISETP", "SEL", "IMNMX", "I2F", "F2I",
                            "BMSK", "SGXT", "FLO", "POPC", "MOV", "IABS", "VIADD", "VIMNMX")),
           ("float ALU / convert", ("FMUL", "FADD", "FFMA", "FSEL", "FSETP", "F2F", "F2FP", "FMNMX", "HADD2",
                                    "HMUL2", "HFMA2", "I2FP")),
           ("barriers/control", ("BAR", "BRA", "WARPSYNC", "NOP", "BSSY", "BSYNC"))]


def opclass(op):
    base = op.split(".")[0]
    for name, ops in CLASSES:
        if base in ops:
            return name
    return "other"


def report(label, name, nw, ns, instrs, notes, tversion):
    m = re.search(r"_n(\d+)_k(\d+)", name)
    bn, bk = int(m.group(1)), int(m.group(2))
    print(f"== {label}: {name}  (num_warps={nw}, num_stages={ns}, triton {tversion})")
    for n in notes:
        print(f"   note: {n}")
    real = [i for i in instrs if not (i[2] == "BRA" and i[3] == hex(i[0]))]   # drop the trailing `BRA self`
    print(f"   total SASS instructions: {len(real)}")
    loop, loops = main_loop(real)
    if loop is None:
        print(f"   no MMA loop found (backward branches: {[(hex(a), hex(b)) for a, b in loops]})")
        return
    body = [i for i in real if loop[0] <= i[0] <= loop[1]]
    threads = 32 * nw
    per_w = len(body) * threads / (bk * bn)
    print(f"   main loop {hex(loop[0])}..{hex(loop[1])} (of {len(loops)} backward branches): {len(body)} "
          f"instructions per thread per iteration; {bk}x{bn} weights an iteration, {threads} threads -> "
          f"{per_w:.2f} instructions a weight")
    base = collections.Counter(i[2].split(".")[0] for i in body)
    print("   opcodes: " + ", ".join(f"{k} {v}" for k, v in base.most_common()))
    cls = collections.Counter(opclass(i[2]) for i in body)
    print("   classes (count, per weight): " + ", ".join(
        f"{k} {v} ({v * threads / (bk * bn):.2f})" for k, v in cls.most_common()))
    full = collections.Counter(i[2] for i in body if i[2].split(".")[0] in ("HMMA", "F2FP", "F2F", "LDGSTS", "LDSM",
                                                                           "LDS", "LDG", "PRMT", "I2F", "I2FP"))
    if full:
        print("   variants: " + ", ".join(f"{k} {v}" for k, v in sorted(full.items())))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compile", nargs=4, metavar=("TTIR", "NUM_WARPS", "NUM_STAGES", "CUBIN"), help=argparse.SUPPRESS)
    ap.add_argument("--tvenv", default="/tmp/tvenv", help="venv with pip triton (default /tmp/tvenv)")
    ap.add_argument("--decodes", default="join,f32,join_t")
    ap.add_argument("--no-bf16", action="store_true", help="skip the bf16-weight grouped matmul")
    ap.add_argument("--options", default="", help="FP4 kernel options, e.g. block_n=64,num_warps=8")
    ap.add_argument("--keep", help="directory for the .ttir / .ptx / .cubin / .sass files (default: a temp dir)")
    ap.add_argument("--M", type=int, default=96)
    ap.add_argument("--K", type=int, default=4096)
    ap.add_argument("--N", type=int, default=2048)
    ap.add_argument("--E", type=int, default=256)
    args = ap.parse_args()
    if args.compile:
        ttir, nw, ns, cubin = args.compile
        compile_ttir(ttir, int(nw), int(ns), cubin)
        return

    sys.path.insert(0, ROOT)
    from benchmarks.timing import parse_options   # needs jax: the project venv's side only

    kinds = [d for d in args.decodes.split(",") if d] + ([] if args.no_bf16 else ["bf16"])
    out = args.keep or tempfile.mkdtemp(prefix="triton_sass_")
    os.makedirs(out, exist_ok=True)
    py = os.path.join(args.tvenv, "bin", "python")
    print(f"M={args.M} K={args.K} N={args.N} E={args.E}, bf16 lhs; files in {out}")
    for kind in kinds:
        label = "bf16 weights" if kind == "bf16" else f"fp4 decode={kind}"
        opts = {} if kind == "bf16" else parse_options(args.options)
        name, ttir, nw, ns, notes = lower_ttir(kind, args.M, args.K, args.N, args.E, opts)
        base = os.path.join(out, f"{kind}")
        with open(base + ".ttir", "w") as f:
            f.write(ttir)
        r = subprocess.run([py, os.path.abspath(__file__), "--compile", base + ".ttir", str(nw), str(ns),
                            base + ".cubin"], capture_output=True, text=True)
        if r.returncode:
            print(f"== {label}: {name}: triton compile failed\n{r.stderr[-3000:]}")
            continue
        info = json.loads(r.stdout.strip().splitlines()[-1])
        sass = subprocess.run([info["cuobjdump"], "-sass", base + ".cubin"], capture_output=True, text=True,
                              check=True).stdout
        usage = subprocess.run([info["cuobjdump"], "-res-usage", base + ".cubin"], capture_output=True, text=True,
                               check=True).stdout
        regs = int(re.search(r"REG:(\d+)", usage).group(1))
        programs = min(65536 // (regs * 32 * nw), (227 * 1024) // max(info["shared"], 1))
        with open(base + ".sass", "w") as f:
            f.write(sass)
        report(label, name, nw, ns, parse_sass(sass), notes + [
            f"{regs} registers a thread, shared memory {info['shared']} bytes a program -> at most {programs} "
            f"programs ({programs * nw} warps) an SM"], info["triton"])


if __name__ == "__main__":
    main()
