"""ptxas resources (registers, spills, shared memory) of the Mosaic GPU attention kernel's variants, on the GPU.

    MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=DIR PYTHONPATH=. python benchmarks/mosaic_resources.py DIR [NAMES]
    PYTHONPATH=. python benchmarks/mosaic_resources.py DIR [NAMES] --offline    # no GPU: benchmarks/mosaic_offline.py

NAMES: comma-separated variant names (default: all). --offline (session 50) lowers and compiles each variant on this
machine with jax's CUDA plugin against a stand-in driver, and prints threads, shared memory and CTAs an SM too.

Mosaic GPU compiles a kernel when it is first called; with MOSAIC_GPU_DUMP_PTXAS set it writes ptxas' verbose log
(one file per kernel) into MOSAIC_GPU_DUMP_TO. This compiles and runs each variant once on a small CSA decode case,
then prints every "registers" / "spill" line of the logs, per variant. Why: session 9 measured the FP8 path's
dequantization at ~10x its instruction-count estimate; spills in the 224-register consumers are the first suspect.
"""

from __future__ import annotations

import contextlib
import glob
import os
import sys
from unittest import mock

import jax
import numpy as np

from benchmarks.sparse_attention import D, make_case
from pallas_kernels.sparse_attention.gpu_mosaic import sparse_attention_mosaic

VARIANTS = [("bf16", False, None, None), ("fp8_cvt", True, None, None), ("fp8_bits", True, "bits", None),
            ("fp8_loop", True, "loop", None), ("fp8_no_convert", True, "no_convert", None),
            ("fp8_no_dequant", True, "no_dequant", None)]
# session 10: every variant above spilled (bf16 184 B, FP8 1.2-1.4 KB) at the default (56, 224) split; these move
# registers from the producer to the consumers
VARIANTS += [(f"{n}_r{p}_{c}", f, None, (p, c)) for n, f in (("bf16", False), ("fp8_cvt", True))
             for p, c in ((40, 232), (24, 240))]
# session 22: the tile-ring FP8 modes (32-row steps) and bf16's own 32-row steps; the converter's consumers get 208
# registers (a 512-thread CTA starts with 128 per thread), the question being whether they spill there
OPTS = {"fp8_pdq": dict(fp8_dequant="producer"), "fp8_converter": dict(fp8_dequant="converter"),
        "bf16_bk32": dict(block_k=32, num_stages=4)}
VARIANTS += [("fp8_pdq", True, None, None), ("fp8_converter", True, None, None), ("bf16_bk32", False, None, None)]
# session 25: the converter shares each step's conversion with the producer (the producer now converts at 56)
OPTS.update({f"fp8_conv{u}": dict(fp8_dequant="converter", conv_units=u) for u in (4, 5)})
VARIANTS += [("fp8_conv4", True, None, None), ("fp8_conv5", True, None, None)]
# session 56: the ring's full barriers per piece of d (each consumer's score chain waits piece by piece)
OPTS["bf16_pieces"] = dict(piece_barriers=True)
VARIANTS += [("bf16_pieces", False, None, None)]
# session 61: the next step's score wgmma in flight under this step's softmax (score_ahead)
OPTS.update({"fp8_ahead": dict(score_ahead=True), "fp8_ahead_conv5": dict(score_ahead=True, conv_units=5),
             "bf16_ahead": dict(score_ahead=True), "bf16_bk32_ahead": dict(block_k=32, num_stages=4, score_ahead=True)})
VARIANTS += [(n, n.startswith("fp8"), None, None) for n in ("fp8_ahead", "fp8_ahead_conv5", "bf16_ahead",
                                                              "bf16_bk32_ahead")]
# session 64: FlashMLA's consumer split (consumers="asym": one consumer scores, the other only runs P.V); the
# register split moved toward the scorer (it holds S, P and its half of o), and the lazy rescale
OPTS.update({"bf16_asym": dict(consumers="asym"), "bf16_asym_lazy": dict(consumers="asym", lazy_rescale=True)})
VARIANTS += [("bf16_asym", False, None, None), ("bf16_asym_lazy", False, None, None),
             ("bf16_asym_r40_232", False, None, (40, 232)), ("bf16_asym_r24_240", False, None, (24, 240))]
OPTS["bf16_asym_r40_232"] = OPTS["bf16_asym_r24_240"] = dict(consumers="asym")
# ... and FlashMLA's whole FP8 shape: its consumer split over the producer's direct FP8 gather (fp8_dequant="direct")
OPTS.update({"fp8_direct_asym": dict(consumers="asym", fp8_dequant="direct"),
             "fp8_direct": dict(fp8_dequant="direct")})
VARIANTS += [("fp8_direct", True, None, None), ("fp8_direct_asym", True, None, None),
             ("fp8_direct_asym_r56_224", True, None, (56, 224))]
OPTS["fp8_direct_asym_r56_224"] = dict(consumers="asym", fp8_dequant="direct")
# session 67: the converter warpgroup's conversion ("cvt", the default since) as one conversion a pair ("rebias",
# the default before) and as none (_diag="bits")
OPTS.update({"fp8_converter_rebias": dict(fp8_dequant="converter", fp8_convert="rebias"),
             "fp8_converter_bits": dict(fp8_dequant="converter")})
VARIANTS += [("fp8_converter_rebias", True, None, None), ("fp8_converter_bits", True, "bits", None)]
# ... and FlashMLA's consumer split over the converter's 32-row tiles (consumers="asym")
OPTS.update({"fp8_converter_asym": dict(fp8_dequant="converter", consumers="asym"),
             "fp8_converter_asym_cu5": dict(fp8_dequant="converter", consumers="asym", conv_units=5),
             "fp8_converter_asym_eager": dict(fp8_dequant="converter", consumers="asym", lazy_rescale=False)})
VARIANTS += [(n, True, None, None) for n in ("fp8_converter_asym", "fp8_converter_asym_cu5",
                                             "fp8_converter_asym_eager")]
# session 68: asym is the FP8 default, so the FP8 variants above without consumers now build it; the pair, named
OPTS["fp8_converter_pair"] = dict(fp8_dequant="converter", consumers="pair")
VARIANTS += [("fp8_converter_pair", True, None, None)]
# ... and the producer taking one or two of the converter's nine passes under asym (the converter sets the pace
# there), at the shared split (56, 56, 200) and with the consumers' 208 kept (48, 48, 208)
for u in (8, 7):
    OPTS[f"fp8_asym_cu{u}"] = OPTS[f"fp8_asym_cu{u}_r48"] = dict(consumers="asym", conv_units=u)
    VARIANTS += [(f"fp8_asym_cu{u}", True, None, None), (f"fp8_asym_cu{u}_r48", True, None, (48, 48, 208))]
OPTS["fp8_asym_noconv"] = dict(consumers="asym")   # the converter storing raw bytes (wrong output: group s68's bound)
VARIANTS += [("fp8_asym_noconv", True, "no_convert", None)]
# session 69: f16 operands under asym over the converter's tiles (one conversion a pair instead of four), and the
# bound without q's in-kernel conversion
OPTS["fp8_asym_f16"] = OPTS["fp8_asym_f16_noq"] = dict(consumers="asym", fp8_operands="f16")
VARIANTS += [("fp8_asym_f16", True, None, None), ("fp8_asym_f16_noq", True, "no_q_convert", None)]
# ... the "owned" chunk order (a thread's row and chunks: static offsets), f16 and bf16 operands
OPTS["fp8_asym_f16_owned"] = dict(consumers="asym", fp8_operands="f16", fp8_chunk_order="owned")
OPTS["fp8_asym_owned"] = dict(consumers="asym", fp8_chunk_order="owned")
OPTS["fp8_asym_f16_owned_cb2"] = dict(OPTS["fp8_asym_f16_owned"], conv_batch=2)
VARIANTS += [("fp8_asym_f16_owned", True, None, None), ("fp8_asym_owned", True, None, None),
             ("fp8_asym_f16_owned_cb2", True, None, None)]
for nb in (2, 3):   # ... and its conversion unrolled in batches of chunks (the loop's 64-bit index math gone)
    OPTS[f"fp8_asym_f16_cb{nb}"] = dict(consumers="asym", fp8_operands="f16", conv_batch=nb)
    OPTS[f"fp8_asym_f16_cb{nb}_r72"] = OPTS[f"fp8_asym_f16_cb{nb}"]
    VARIANTS += [(f"fp8_asym_f16_cb{nb}", True, None, None), (f"fp8_asym_f16_cb{nb}_r72", True, None, (40, 72, 200))]

# session 70: the producer's FP8 row copies as two 1-D bulk copies (fp8_copy="bulk"; a "lanes" mode, a lane a row,
# compiled without spills but faulted on an H100 and is gone)
for fc in ("bulk",):
    OPTS[f"fp8_asym_{fc}"] = dict(consumers="asym", fp8_copy=fc)
    OPTS[f"fp8_asym_f16_owned_{fc}"] = dict(OPTS["fp8_asym_f16_owned"], fp8_copy=fc)
    OPTS[f"fp8_consumers_{fc}"] = dict(fp8_dequant="consumers", fp8_copy=fc)
    VARIANTS += [(f"fp8_asym_{fc}", True, None, None), (f"fp8_asym_f16_owned_{fc}", True, None, None),
                 (f"fp8_consumers_{fc}", True, None, None)]
# ... and a quarter of P.V moved from the scorer to the helper (asym_scorer_cols=128; regs (40, 56, 184, 232))
OPTS["fp8_asym_sc128"] = dict(consumers="asym", asym_scorer_cols=128)
OPTS["fp8_asym_f16_owned_sc128"] = dict(OPTS["fp8_asym_f16_owned"], asym_scorer_cols=128)
OPTS["fp8_asym_f16_owned_sc128_bulk"] = dict(OPTS["fp8_asym_f16_owned_sc128"], fp8_copy="bulk")
OPTS["fp8_asym_sc128_cu5"] = dict(consumers="asym", asym_scorer_cols=128, conv_units=5)
VARIANTS += [(n, True, None, None) for n in ("fp8_asym_sc128", "fp8_asym_f16_owned_sc128",
                                             "fp8_asym_f16_owned_sc128_bulk", "fp8_asym_sc128_cu5")]
# ... and q's first columns in the scorer's registers (asym_q_regs)
for qr in (128, 192, 256, 320):
    OPTS[f"fp8_asym_sc128_qr{qr}"] = dict(consumers="asym", asym_scorer_cols=128, asym_q_regs=qr)
    OPTS[f"fp8_asym_f16_owned_sc128_bulk_qr{qr}"] = dict(OPTS["fp8_asym_f16_owned_sc128_bulk"], asym_q_regs=qr)
    VARIANTS += [(f"fp8_asym_sc128_qr{qr}", True, None, None), (f"fp8_asym_f16_owned_sc128_bulk_qr{qr}", True, None,
                                                                 None)]
OPTS["fp8_asym_qr64"] = dict(consumers="asym", asym_q_regs=64)
VARIANTS += [("fp8_asym_qr64", True, None, None)]
# session 71: the five FP8 defaults (f16, owned, bulk, scorer cols 128, q_regs 256) spill 80 B in the producer at
# its 40 registers (the bulk copies' per-row addresses); register splits that give the producer more
for r4 in ((48, 48, 184, 232), (48, 56, 176, 232), (48, 56, 184, 224), (56, 40, 184, 232)):
    VARIANTS += [(f"fp8_defaults_r{'_'.join(map(str, r4))}", True, None, r4)]
# session 72: a third 32-row tile slot for two staging slots (what fits), under the FP8 defaults, and register
# splits that give the converter more (t3s2 spills 20 B in the converter's loop at 56)
OPTS["fp8_t3s2"] = dict(tile_slots=3, num_stages=2)
VARIANTS += [("fp8_t3s2", True, None, None)]
for r4 in ((40, 64, 184, 224), (32, 64, 184, 232), (40, 64, 176, 232)):
    OPTS[f"fp8_t3s2_r{'_'.join(map(str, r4))}"] = OPTS["fp8_t3s2"]
    VARIANTS += [(f"fp8_t3s2_r{'_'.join(map(str, r4))}", True, None, r4)]
OPTS["fp8_asym_profiled"] = dict(consumers="asym", _profile="/tmp/mosaic_resources_profile")   # the phase profile's build
VARIANTS += [("fp8_asym_profiled", True, None, None)]
OPTS["fp8_consumers"] = dict(fp8_dequant="consumers")   # (the consumers' own conversion, for the spill figures)
VARIANTS += [("fp8_consumers", True, None, None)]


def main(out_dir: str, only: list[str] | None, offline_mode: bool):
    offline = None
    if offline_mode:
        from benchmarks.mosaic_offline import OfflineMosaic

        offline = OfflineMosaic(out_dir)
        print(f"offline: {offline.ptxas_version.splitlines()[-1]} (cuda root {offline.cuda_root})", flush=True)
    elif not os.environ.get("MOSAIC_GPU_DUMP_PTXAS") or not os.environ.get("MOSAIC_GPU_DUMP_TO"):
        raise SystemExit("set MOSAIC_GPU_DUMP_PTXAS=1 and MOSAIC_GPU_DUMP_TO=<existing dir>, or pass --offline")
    rng = np.random.default_rng(0)
    for name, fp8, diag, regs in VARIANTS:
        if only and name not in only:
            continue
        before = set(glob.glob(os.path.join(out_dir, "*")))
        q, wpool, cpool, sinks, widx, cidx = make_case(rng, "csa", 4, 1, 512, 4096, fp8, 1)
        fn = jax.jit(lambda *a, diag=diag, regs=regs, o=OPTS.get(name, {}): sparse_attention_mosaic(
            *a, scale=D ** -0.5, _diag=diag, regs=regs, **o))
        if offline:
            # a profiled build dumps its trace through a host callback, which cannot lower for CUDA on this machine:
            # dropped here (the kernel, with its profiler records, is what is compiled)
            with mock.patch("jax.debug.callback", lambda *a, **k: None) if "_profile" in OPTS.get(name, {}) \
                    else contextlib.nullcontext():
                for r in offline.compile_jitted(fn, q, wpool, widx[0], cpool, cidx[0], sinks):
                    print(f"== {name}: {r.line()}", flush=True)
            continue
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
    argv = [a for a in sys.argv[1:] if a != "--offline"]
    main(argv[0] if argv else os.environ["MOSAIC_GPU_DUMP_TO"], argv[1].split(",") if len(argv) > 1 else None,
         "--offline" in sys.argv[1:])
