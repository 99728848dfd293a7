"""Lightning-indexer decode scores over fp8, fp4 or bf16 keys on the H200's tensor cores (Pallas, Mosaic GPU backend).

    indexer_scores_mosaic(q, weights, keys, n_visible, *, block_t=None, num_stages=None, num_splits=None,
                          pad_to_block=False, precision=None) -> scores [B, S, T] f32
                                                                (the contract of reference.indexer_scores)

Why: the Triton scores kernel converts every e4m3 key to f16 in registers before its MMA; at B = 64 x 128K context
it runs at 1.8x its byte floor (131 vs 73 us, session 18), and Triton's code for fp8 operands was slower still
(204 us, session 10). Here no key byte is touched by an ALU on the fp8 path (precision "fp8"): TMA streams each
block of keys into shared memory in the layout the tensor cores read (128 B rows, 128 B swizzle) and one wgmma
e4m3 x e4m3 -> f32 takes them from there. Session 27 added bf16 keys (`formats` "bf16" and exact mode with a bf16
model): the Triton kernel ran them at 1.27-1.35x their byte floor; here TMA feeds them to bf16 wgmmas unchanged.
Session 31 added fp4 keys (packed e2m1 + 4 ue8m0 group scales, 68 B): the Triton kernel ran them at 3.2x their
floor (168 us at B = 64 x 128K); here 110 us (scores alone; B = 64 x 1M: 797 vs 1283 us on Triton).

Key formats and precisions (`PRECISIONS`; the first is the default):
* fp8 keys (`formats.QuantizedKeys`, fmt "fp8"): "f16" (e4m3 codes -> f16 in registers, exact, the wgmma's A operand
  from registers), "fp8" (e4m3 x e4m3 wgmma straight from shared memory; ~1.3e-4 relative, the fp8 tensor cores'
  accumulation). q arrives fake-quantized like the keys (q = e4m3 code x 2^e per (token, head)) or raw.
  `gpu.quantize_q_fp8` recovers that code and scale exactly (tested bit for bit) and rounds a raw q to the same
  values, the scale joins the head weight (ReLU(s x) = s ReLU(x) for s > 0), and the key's power-of-two scale
  multiplies the head-weighted sum. Every product of two e4m3 codes is exact in f32, so the scores equal the
  reference up to the order (and the tensor cores' internal precision) of the f32 sums. Since session 42 the model's
  indexer passes q raw (`quantize_q=True`, `layers/indexer.py`), and the dispatcher fake-quantizes it only for the
  other paths.
* fp4 keys (`formats.QuantizedKeys`, fmt "fp4"): "fp8" (the default since session 46) or "f16". TMA brings each
  block's packed bytes [block_t, 64] (64 B rows, 64 B swizzle) and its scales (a key's 4 bytes as one int32); with
  "f16" `mosaic_fp4.fp4_operand` turns them into the f16 A operand in registers by inline PTX: the nibbles' bits
  placed as f16 (e2m1 x 2^-14, exact) times the group's factor 2^(15 - D) (D: the group's distance below the key's
  largest scale; exact for D <= 24), written into WGMMA registers of `mosaic_fp4.register_plan`'s choosing, with q's
  128 channels permuted to match (a dot product is indifferent to the order of its K dimension). The key's 2^(smax -
  128) multiplies its score. q arrives fake-quantized to fp4, or raw: with MOSAIC_CONFIG q_prep "triton" (the default)
  one kernel does the fake quantization, divides each (token, head) by a power of two (into the head weight) and
  rounds to f16, so the dispatcher's `quantize_q=True` skips its own (`quantizes_q`); q_prep "xla" does the division
  in jnp and needs q fake-quantized. Precision "fp8" (session 45; the default since session 46: H100, B = 64 x 128K,
  105.6 vs 124.5 us the whole set pipeline, 88.8 vs 107.7 the scores kernel alone): the nibbles become e5m2 bytes
  instead (`mosaic_fp4.FP4_E5M2X8_ASM`: a table lookup per nibble, the group's 8 magnitudes x 2^(13 - D) in two
  registers, ~13 integer ops per 8 values against ~26 for f16; exact for D <= 26) in the wgmma's 8-bit register
  layout, q as e5m2 codes (`gpu.quantize_q_fp8` after q's fp4 fake quantization, so a raw q works too; one Triton
  kernel with q_prep "triton", `q_prep.q_prep_fp4(e5m2=True)`), and one e5m2 x e5m2 wgmma: twice the f16 tensor rate,
  where the f16 path is compute-bound (2.35x its floor on the H100, session 44). The register plan puts every
  32-channel scale group in its own K-step of 32, so an instruction's products share their scales; the fp8 tensor
  cores' accumulation is the only difference to the reference (~1e-4 relative).
* fp4 keys through a converter warpgroup (`fp4_converter`, session 49, precision "fp8"; off by default until
  timed): the CTA has two warpgroups. wg 1 streams the key ring, turns each block's nibbles into e5m2 with the same
  inline PTX and stores them (and the keys' score factors) into a ring of e5m2 slots in shared memory; wg 0 takes
  each slot into the e5m2 x e5m2 wgmma straight from shared memory, as it takes fp8 keys, then the epilogue. So the
  conversion (~25 us of the register path's ~83 us at B = 64 x 128K on an H100, session 48) leaves the scoring
  warpgroup's serial chain. Barriers: conv_full (wg 1's stores fenced for the async proxy, 128 arrivals) and
  conv_empty (wg 0's wgmma done with the slot). It is also the fp4 path Pallas' GPU interpreter runs (a jnp model of
  the conversion, equal to the asm bit for bit).
* bf16 keys (a bfloat16 [B, T, 128] array): "bf16x2" (q split into bf16 hi + the bf16-rounded remainder, two wgmmas
  into one accumulator: q to ~16 mantissa bits, as the Triton kernel's default for bf16 keys), "bf16" (q rounded to
  bf16, one wgmma; exact for a bf16 q). Products of two bf16 values are exact in f32.

CTA = (query row r = (b, s), split of the key blocks), one warpgroup:
* q [H, 128] (bf16x2: [2, H, 128]) and the row's head weights [H] land once (TMA); n_visible[r] is read from
  global memory.
* the split's visible blocks (`block_t` keys each, blocks at or past n_visible are not read) stream through a ring
  of `num_stages` slots: keys [block_t, 128] (+ their f32 scales [block_t] for fp8), one barrier per slot;
* per block: logits = K q^T [block_t, H] (wgmma, M = block_t, N = H, K = 128, both operands K-major in shared
  memory), ReLU, x weight, sum over H (a row reduction of the accumulator), x key scale (fp8), -inf at
  t >= n_visible; the [block_t] scores go out through a two-slot shared buffer by TMA, and the slot's refill is
  issued once every thread is past it (`commit_smem` is a warpgroup barrier);
* the split's blocks past n_visible get -inf without reading keys.
Keys are copied as [block_t, 128] boxes of the [B, T, 128] array (TMA fills rows past T with zeros; T must be a
multiple of 8, the tile's rows); the fp8 scales as a flat [B * T] array (a TMA row stride must be a multiple of
16 B, which [B, T] f32 would need T % 4 for): a block running past T reads the next row's scales, and the mask
discards those entries.

Options measured in session 30 (H200, B = 64 x 128K, `results/README_indexer_compressor.md`); split_m and the
group maxima (`gpu.indexer_topk_gpu`'s fuse_group_max) are the defaults since session 31:
* convert (precision "f16"): "cvt" (default), "alu" / "mix" (integer bit placement, alone or sharing the work with
  the conversion instruction), "raw" (a timing probe, wrong values). Without any conversion the kernel took as long
  (100.4 vs 101.7 us), so the conversions are not its bound; "alu" (129.6) and "mix" (117.7) are slower. fp4 keys
  take "raw" too (session 46, either precision): the packed words go to the MMA as they are, without the per-8-value
  conversion (the per-key-group tables / factors stay), so its time against the default's shows what the
  conversion costs.
* group_max_k: the top-k's strided-group maxima as per-CTA partials (saves the top-k's XLA pass, ~3 us more here).
* split_m: each block as two [block_t / 2, H] wgmmas into two accumulators, the halves' load / wgmma / epilogue
  overlapped. With group_max_k the `threshold_set` pipeline took 2-6 us less (fp8 137.5 vs 139.7, bf16 182.1 vs
  185.4); alone it is within the noise.

Where the time goes (session 74, `benchmarks/indexer_phase_profile.py` with MOSAIC_CONFIG["profile"]; H100, fp4
keys, B = 64 x 128K, segment top-k): the scorer and the converter each spend ~2050-2400 cycles a 128-key block and
wait for each other or the keys only 7-11% of it, so their own work sets the pace, not the bytes (the floor is
~1630 cycles a block there, ~1160 on the H200). The ordering between them is what session 74 cut: the scorer's
segment scores under one barrier (seg_sync "barrier", the default); the converter's hand-over without warpgroup
barriers (conv_sync "arrive") passed on the GPU but was no faster, as its keys then came late (session 75). Two
options of session 75, compiled offline but not yet run on a GPU, balance the two warpgroups: the converter issues
its key copies right after the conversion (conv_sync "early") and counts the streamed histogram instead of the
scorer (seg_hist "converter"), which leaves the scorer's loop without a barrier. With the latter, session 76's
select_wgs 2 has the converter, idle once its blocks are done, run the split's selection with the scorer (256
threads; the selection was 13% of the kernel at 128K, overlapped by nothing): also compiled offline only.

Decode-oriented: one query per CTA, so S queries of one row read its keys S times (prefill stays on the Triton
kernel, whose programs share each key block between up to 8 queries). Hopper (sm_90a) only. On the CPU it lowers
for CUDA (tests/test_gpu_lowering.py), and `interpret=True` (or "races", with the race detector) runs it in Pallas'
GPU interpreter (simulated shared memory, barriers and TMA; jax >= 0.10) for precisions "fp8", "bf16x2" and "bf16":
the interpreter's wgmma takes no register operand (fp8's "f16") and no transposed one (q is passed [.., 128, H]
there), and has no register layouts.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from . import formats
from .q_prep import HEAD_BLOCK as Q_PREP_HEAD_BLOCK

N_SM_H200 = 132
# splits of the key range: ~2 CTAs per SM, all resident at once (a second wave of CTAs cost 20-25%: B = 64 x 128K,
# f16, 9 splits = 576 CTAs 125.7 us, 4 splits = 256 CTAs 101.8 us; session 20), each with >= MIN_BLOCKS blocks
TARGET_CTAS = 2 * N_SM_H200
MIN_BLOCKS = 4
# per key format; the first is the default. fp4's "fp8" since session 46 (H100, B = 64 x 128K: 105.6 vs 124.5 us
# for the whole set pipeline; the f16 path is compute-bound, fp4's own rounding dwarfs the fp8 tensor cores' ~1e-4)
PRECISIONS = {"fp8": ("f16", "fp8"), "bf16": ("bf16x2", "bf16"), "fp4": ("fp8", "f16")}
# kernel="auto" takes the Mosaic kernel for up to MAX_QUERIES queries per row (decode, MTP) and at least MIN_ROWS
# query rows: on the H200 (session 20, scores kernel, us) it wins at B = 64 (128K context: 106.8 vs 128.7 on Triton;
# 32K: 39.3 vs 40.9) and does not at B = 1 (128K: 13.5 vs 11.7; 1M: 23.1 vs 23.3)
MAX_QUERIES = 2
MIN_ROWS = 16
# ... while AUTO is True (set it False before tracing to keep kernel="auto" on Triton everywhere). It was False in
# session 20, when the GPU model test with this kernel in decode failed on one of 16 rows. Session 21 found the
# cause outside the kernel: XLA's GPU compiler had dropped the indexer q's fake quantization (an f32 -> e4m3 -> f32
# round trip, removed under --xla_allow_excess_precision), so this kernel, which re-quantizes q, scored a different
# q than the reference path (formats.fake_quantize now keeps the rounding behind an optimization barrier). The
# model test passes on the H200 with either kernel since.
AUTO = True
# the key formats kernel="auto" sends here. bf16 since session 27 (H200, B = 64, scores us: 128K context 155.8 vs
# 189.4 on Triton, 32K 52.1 vs 61.7; B = 16 x 128K 46.7 vs 58.7)
# fp4 since session 31 (H200, B = 64, scores us: 128K context 118.5 vs 168.2 on Triton, 1M 888.9 vs 1283.4)
AUTO_FORMATS = ("fp8", "bf16", "fp4")
# ... and below MIN_ROWS query rows for these formats where the rows' 128-key blocks fill a wave of CTAs
# (>= MIN_KEY_BLOCKS): bf16 keys, B = 1 x 1M context (2048 blocks), 30.9 vs 39.5 us on Triton; at 128K (256
# blocks) 14.1 vs 14.4 (session 28). fp8 keys at B = 1 x 1M: 23.1 vs 23.3 (session 20), so they stay on Triton
FEW_ROW_FORMATS = ("bf16",)
MIN_KEY_BLOCKS = TARGET_CTAS * MIN_BLOCKS
# precision="f16": how the e4m3 key codes become the f16 A operand (`CONVERTS`; "cvt" is the default).
# * "cvt": the hardware conversion, cvt.rn.f16x2.e4m3x2 (two per 4 codes).
# * "alu": integer bit placement, no conversion instruction (`E4M3_F16_ALU_ASM`): byte b = s eeee mmm becomes the f16
#   bits s 0eeee mmm0000000, which is the e4m3 value x 2^-8 exactly, subnormals included (both formats' subnormals
#   are 0.m x 2^(1 - bias): 2^-6 vs 2^-14) and zero. The 2^8 goes into the head weights (exact, a power of two).
#   e4m3 NaN bytes come out finite; the quantizer never writes them.
# * "mix": "cvt" for even registers, "alu" for odd ones, the cvt'd pairs scaled by 2^-8 (one exact f16x2 multiply)
#   so both halves carry the same factor: the conversion pipe and the integer pipe share the work.
# * "raw" (timing diagnostic only, wrong values): the code bytes passed through as if they were f16 pairs.
CONVERTS = ("cvt", "alu", "mix", "raw")
# the per-key epilogue (`indexer_scores_mosaic(epilogue=)`): "full" (ReLU, x head weight, sum over the heads), or
# "probe" (timing only, wrong values: the first 8 heads' logits summed)
EPILOGUES = ("full", "probe")
# split_m's default per key format where it applies (session 31). fp8 / bf16: with the top-k's group maxima from this
# kernel, the `threshold_set` pipelines took 2-6 us less on the H200 (session 30). fp4: off, its two halves' decode
# is slower (B = 64 `threshold_set`: 128K 157.6 us with, 144.7 without; 1M 983.6 / 913.4; results/h200_s31r4_idx.log)
DEFAULT_SPLIT_M = {"fp8": True, "bf16": True, "fp4": False}
F16_BIAS_SHIFT = 8   # "alu" / "mix" give the key value x 2^-8
# $2 = 4 e4m3 codes (bytes 0..3); $0 = f16 pair of bytes 0, 1, $1 = bytes 2, 3 (low half = the lower byte), x 2^-8.
# prmt puts byte i in the high byte of a 16-bit half; the sign bit stays, exponent and mantissa move right by one.
E4M3_F16_ALU_ASM = """{ .reg .b32 z, p, t;
mov.b32 z, 0;
prmt.b32 p, $2, z, 0x1404;
shr.b32 t, p, 1;
and.b32 t, t, 0x3F803F80;
and.b32 p, p, 0x80008000;
or.b32 $0, p, t;
prmt.b32 p, $2, z, 0x3424;
shr.b32 t, p, 1;
and.b32 t, t, 0x3F803F80;
and.b32 p, p, 0x80008000;
or.b32 $1, p, t; }"""
# the same pairs by the hardware conversion, each x 2^-8 (f16 0x1C00) for "mix": exact, an e4m3 value x 2^-8 is at
# least 2^-17, above f16's smallest subnormal
E4M3_F16_CVT_SCALED_ASM = """{ .reg .b16 a, b; .reg .b32 c;
mov.b32 {a, b}, $2;
mov.b32 c, 0x1C001C00;
cvt.rn.f16x2.e4m3x2 $0, a;
cvt.rn.f16x2.e4m3x2 $1, b;
mul.rn.f16x2 $0, $0, c;
mul.rn.f16x2 $1, $1, c; }"""
RAW_ASM = "{ mov.b32 $0, $2; mov.b32 $1, $2; }"


def e4m3_to_f16_alu_reference(codes):
    """numpy model of `E4M3_F16_ALU_ASM` on uint8 codes [4n] -> the f16 bit patterns [4n] uint16 it produces (for
    the CPU test of the constants: they must equal float16(e4m3 value x 2^-8))."""
    import numpy as np

    w = codes.astype(np.uint32).reshape(-1, 4)

    def prmt_hi(lo_byte, hi_byte):   # bytes [0, lo, 0, hi]
        return (lo_byte << 8) | (hi_byte << 24)

    def place(p):
        return (p & 0x80008000) | ((p >> 1) & 0x3F803F80)

    w0 = place(prmt_hi(w[:, 0], w[:, 1]))
    w1 = place(prmt_hi(w[:, 2], w[:, 3]))
    out = np.stack([w0 & 0xFFFF, w0 >> 16, w1 & 0xFFFF, w1 >> 16], axis=1)
    return out.reshape(-1).astype(np.uint16)


def _e4m3_to_f16(a8, mode):
    """The loaded e4m3 key tile (WGMMA_UPCAST_2X registers, 4 codes each) -> f16 in the same layout, by `mode` in
    ("alu", "mix", "raw") through inline PTX, register by register ("cvt" is a plain astype)."""
    import numpy as np
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import llvm, vector
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    from jax.experimental.pallas import mosaic_gpu as plgpu

    layout = plgpu.Layout.WGMMA_UPCAST_2X

    @plgpu.inline_mgpu(arg_types=(layout,),
                       return_type=plgpu.ShapeDtypeStruct(a8.shape, jnp.float16, layout=layout))
    def convert(_, x):
        i32 = ir.IntegerType.get_signless(32)
        pair_ty = ir.Type.parse("!llvm.struct<(i32, i32)>")
        regs = np.empty(x.registers.shape, dtype=object)
        for n, (idx, reg) in enumerate(np.ndenumerate(x.registers)):
            word = mgpu_utils.bitcast(reg, i32)
            asm = RAW_ASM if mode == "raw" else (
                E4M3_F16_CVT_SCALED_ASM if mode == "mix" and n % 2 == 0 else E4M3_F16_ALU_ASM)
            pair = llvm.inline_asm(pair_ty, [word], asm, "=r,=r,r")
            words = [llvm.extractvalue(i32, pair, [i]) for i in range(2)]
            regs[idx] = vector.bitcast(ir.VectorType.get((4,), ir.F16Type.get()),
                                       vector.from_elements(ir.VectorType.get((2,), i32), words))
        return mgpu.FragmentedArray(_registers=regs, _layout=x.layout, _is_signed=None)

    return convert(a8)


# select_k (`indexer_scores_mosaic`; the indexer's topk="segment_set"): each CTA keeps its split's scores in shared
# memory and writes their top-k superset (`mosaic_select`). slack: slots = k + slack a CTA (the tournament's
# seg_slack); max_segment: the most keys a split may hold (their int32 u keys stay in shared memory: 32 KB at 8192;
# more splits where the default's would hold more); num_stages: the key ring's depth there (3 x 16 KB of fp8 keys,
# so that two CTAs of ~111 KB, with the 32 KB of u keys and the 8 KB histogram, fit an SM)
# aggregate: the selection's histogram atomics grouped by bin within a warp (`mosaic_select.segment_select_ptx`).
# stream_hist: the selection's first histogram level counted block by block during the stream (one atomic per key
# after each block's barrier), so the tail after the last block starts at the bin search.
# final: where the row's set is selected among its splits' survivors: "triton" (the survivors go to global memory,
# then `topk_hist.hist_select` with the position map), "cluster" (the row's splits are one thread-block cluster: CTA 0
# gathers the others' survivors from their shared memory and selects the exact set, so the call is one kernel; needs
# <= MAX_CLUSTER splits, k + slack a multiple of 4 and k <= 1024), "auto" (cluster where it applies). "triton" is
# the default: on the H200 (session 40, B = 64 x 128K fp8, CUPTI) the clustered launch alone made the kernel 145 us
# instead of 90 (no selection in either; 64 clusters of 4 CTAs of ~111 KB of shared memory), the whole call 185 vs
# 122.5 us.
# "last" (session 41; session 44 on an H100: correct, 7 + 11 GPU tests; the kernel time drops 2.5 us at B = 64 x 128K
# fp8 but the call's does not, the counters' zero-fill being one more launch, so it stays off): every split CTA writes
# its survivors to global memory and adds 1 to its row's counter (a zeroed GMEM semaphore array); the CTA that arrives
# last selects the row's set among the row's survivors (read back from L2), so no Triton kernel follows and no CTA
# waits. It applies where a row's survivors (u keys and positions) fit the split's segment buffer, 2 x n_split x (k +
# slack) <= the split's keys (B = 64 x 128K: 4 splits of 8192 keys, 4608 words), and k + slack is a multiple of 4 and k
# <= 1024; elsewhere the Triton final runs.
# prune (session 41; session 44 on an H100: survivors equal the numpy model bit for bit, 19 GPU tests, but it saves 1.6
# of the tail's ~9.4 us at B = 64 x 128K fp8, within the noise of the call, and costs 3 us on fp4 keys; 0 = off, the
# default): the capacity of a candidate list (int32 entries in shared memory). After the split's first half of blocks,
# the first level's bin of their k-th largest key bounds the split's top k from below; each later block appends its
# entries at or above that bound to the list as it streams (`mosaic_select.prune_append_ptx`), the first level stops
# counting, and after the last block the selection runs over the list (~1.3K entries for normal scores at k = 512 of
# 8192) instead of the split. A list that would overflow, or a split too short to reach the threshold, selects over the
# whole split. Needs stream_hist; the key ring then has at most prune_stages slots (the list's shared memory: 2048
# entries, 8 KB).
# probe (a timing diagnostic, wrong picks; the outputs are left unwritten): 1 = no selection after the stream, 2 = the
# selection's histogram levels and bin searches but not its compaction (session 41)
SELECT_CONFIG = dict(slack=64, max_segment=8192, num_stages=3, aggregate=False, stream_hist=True, final="triton",
                     probe=0, prune=0, prune_stages=2)
MAX_CLUSTER = 8     # portable thread-block cluster size
# q_prep: how q's operand and head weights are made before the kernel over fp8 / fp4 keys: "triton" (the default since
# session 44: one Pallas kernel, equal bit for bit: `q_prep.q_prep_fp8`, session 41; `q_prep.q_prep_fp4`, session 42,
# which also fake-quantizes q to fp4, so a raw q gives the operand of a fake-quantized one, as on the fp8 path either
# way) or "xla" (jnp: the per-head amax, the codes, w x s; two or three small XLA kernels a call, after the
# dispatcher's fake quantization of q for fp4 keys). Session 44 (H100, B = 64 x 128K, the model's raw-q path, net
# of dispatch): fp4 141.2 -> 122.5 us a call, fp8 121.5 -> 120.0; a q that arrives fake-quantized loses ~3 us on fp4
# keys (125.6 vs 122.3: the Triton kernel repeats the fake quantization). `quantizes_q` says which paths take a raw q.
# "fused" (session 76): with a multiple of 64 heads, on fp4 keys at precision "fp8" through the converter's rows
# layout (the default fp4 path) and on fp8 keys with convert "cvt" (the default), the scoring warpgroup prepares its
# own row's q and head weights before its first block (`q_prep.fp4_q_operand_e5m2_rows` / `fp8_q_operand_rows`: the
# Triton kernel's values, from raw q loaded straight from global memory into the WGMMA register layout) while the
# first key blocks stream in (and, for fp4, the converter converts them): one kernel fewer a call (the Triton q
# kernel took 2.3-2.8 us (fp4) and 1.8 us (fp8) on the H100, session 54, plus its launch gap). Every split CTA of a
# row repeats it (64 x 128 values). Elsewhere "fused" is "triton". Compiled offline and interpreted only (the device
# pool was paused): `HIST=1 bash benchmarks/run_gpu_pending.sh` times it. Kernel name `_qf`.
# epilogue: `EPILOGUES` ("probe" only to time what the per-key epilogue costs; wrong values)
# fp4_converter (session 49; fp4 keys at precision "fp8"; 0 = off): the number of e5m2 slots [block_t, 128] in
# shared memory through which a second warpgroup hands converted blocks to the scoring one
# (`indexer_scores_mosaic(fp4_converter=)`). The default (2, with fp4_layout "auto") applies where the converter can
# run: fp4 keys at precision "fp8", convert "cvt", no split_m; an explicit fp4_converter= elsewhere is an error.
# fp4_tables (with fp4_converter; `FP4_TABLES`): "registers" (each of the 4 threads that hold a key's row builds its
# e5m2 tables, 35 SASS a row and thread) or "shared" (thread t builds key t's tables once into shared memory, the 4
# threads load them back; block_t a multiple of 128)
# fp4_layout (with fp4_converter; `FP4_LAYOUTS`; session 50): how the converter's threads split a block:
# "fragments" (4 threads a key row, 32-bit accesses: the WGMMA fragment layout that the register path needs),
# "rows" (a thread a row, 16-byte accesses, tables once a key, q unpermuted: `mosaic_fp4.fp4_operand_rows`;
# block_t a multiple of 128, else an error; fp4_tables does not apply), or "auto" (the default): "rows" where
# block_t is a multiple of 128 and fp4_tables is "registers", else "fragments".
# Timed on the H200 (session 51, results/README_indexer_compressor.md), fp4 keys under the segment top-k, net of
# the harness: B = 64 x 128K 88.9 us (register path) -> 82.5 (converter 2 + rows; 84.4 with 1 slot, 107.9 with
# 3), B = 1 x 1M 25.8 -> 22.2, B = 16 x 128K 33.3 -> 32.6. Counted offline (benchmarks/mosaic_offline.py): the
# converter loop issues 279 SASS a block with "rows" against 429 with "fragments".
# q_prep_heads: heads a program of the "triton" q preparation (default `q_prep.HEAD_BLOCK`; session 54: one program
# a row before, 64 heads)
# profile (session 74; diagnostic, "" = off): a directory. Each compiled call then records, in thread 0 of each
# warpgroup, the SM clock at the entry and exit of the kernel's named regions (`PROFILE_REGIONS`) through Mosaic
# GPU's on-device profiler, and dumps a Chrome trace per call there (benchmarks/indexer_phase_profile.py reads it).
# The records take profile_words_per_block(..) x 4 B of shared memory a block and warpgroup. profile_detail (with
# profile): the ordering work a region holds in a region of its own (`PROFILE_DETAIL_REGIONS`): one region more a
# block, which at B = 64 x 128K fp4 no longer leaves 2 CTAs an SM (use 64K context there).
# seg_sync (session 74; fp4 keys through the converter under the segment top-k): how the scorer orders a block's
# scores in the segment buffer before the streamed histogram reads them. "barrier": plain stores and one warpgroup
# barrier. "commit" (the code before session 74): Pallas' store, which brackets it with two warpgroup barriers,
# then commit_smem (an async-proxy fence and a third barrier), none of which that path needs: nothing in the
# async proxy reads the segment buffer, and the e5m2 slot was released by its own barrier. Session 74's profile
# (H100, B = 64 x 128K): the scorer's epilogue, which holds them, took 841 of its ~2380 cycles a block.
MOSAIC_CONFIG = dict(q_prep="triton", epilogue="full", fp4_converter=2, fp4_tables="registers", fp4_layout="auto",
                     q_prep_heads=Q_PREP_HEAD_BLOCK, profile="", profile_detail=False, seg_sync="barrier",
                     conv_sync="commit", seg_hist="scorer", select_wgs=1)
SEG_SYNCS = ("barrier", "commit")
# conv_sync (session 74; the fp4 converter warpgroup): how a converted block is handed over and its key slot refilled.
# "arrive": each converter thread fences its own stores for the async proxy and arrives on the slot's full barrier
# (128 arrivals), with no warpgroup barrier; the scorer, once that barrier completes (every converter thread is past
# its reads of the block's key slot), issues the slot's next copy. "commit" (the code before): commit_smem (the fence
# and a warpgroup barrier), the arrival, then the converter issues the copy, which Pallas brackets with a warpgroup
# barrier for each of its two copies: three barriers a block. Session 74's profile (H100, fp4, B = 64 x 64K): that
# part took 510 of the converter's ~2180 cycles a block, and the converter had become the pace-setter. "arrive"
# applies where the converter's tables are its own (fp4_tables "registers"; "shared" needs the closing barrier, so
# it keeps "commit"). Session 75 (H100, `CONV_SYNC=1`, h100_s75r1): its GPU cases and the fp4-key model test pass,
# but it is no faster (B = 64 x 128K fp4, own us 82.4 vs 81.8): the converter's stores fell from 738 to 350 cycles
# a block, but its keys came late (it waited 710 cycles a block for them, 150 with "commit"), since the scorer,
# which issues the copies there, runs up to two blocks behind the converter.
# "early" (session 75): the converter issues the key slot's next copy right after the block's conversion (Pallas'
# copy brackets it with the warpgroup barrier that orders every thread's reads of the slot before it), then each
# thread fences its stores and arrives as with "arrive": one of commit's three barriers gone and the copy issued a
# store phase sooner. Interpreted with the race detector and compiled offline only (2 barriers a block; the device
# pool was paused): `HIST=1 bash benchmarks/run_gpu_pending.sh` runs and times it.
CONV_SYNCS = ("arrive", "commit", "early")
# seg_hist (session 75; fp4 keys through the converter under the segment top-k, streamed histogram, no pruning):
# which warpgroup counts each block's scores into the selection's first histogram level. "scorer" (the code
# before): the scoring warpgroup, after a warpgroup barrier over its score stores. "converter": each scorer thread
# arrives on the block's seg_ready barrier after its plain stores (mbarrier arrive / wait: release / acquire at CTA
# scope), and the converter warpgroup, HIST_LAG blocks behind (so it rarely waits), zeroes and counts the
# histogram (`mosaic_select.hist_block`, wg_local), then arrives on hist_done, which the scorer waits for before
# its selection. Session 74's profile (H100, B = 64 x 128K): the scorer's streamed histogram and its barrier took
# ~440 of its ~2380 cycles a block while the converter waited ~300 of its ~2050; this moves them across. The
# pruned selection keeps "scorer" (its threshold is the scorer's). Compiled offline only (the scorer's loop: 231
# SASS, no barrier; 2 CTAs an SM at 128K and 1M; the histogram PTX in a second warpgroup run by tests/ptx_sim.py);
# the selection's PTX does not interpret, so its first GPU run is `HIST=1 bash benchmarks/run_gpu_pending.sh`.
SEG_HISTS = ("scorer", "converter")
Q_PREPS = ("xla", "triton", "fused")
# select_wgs (session 76; with seg_hist "converter", the plain selection: final "triton", no probe): the
# warpgroups that run the split's selection after its last block. 1: the scorer alone (128 threads), while the
# converter warpgroup, its blocks done, idles to the end. 2: the converter joins it (`mosaic_select`'s
# threads=256: every pass over the split's entries over 8 warps, the bin searches over 256 threads, a named
# barrier of their own). Session 75's profile (H100, fp4, B = 64 x 128K): the selection took ~19.7K cycles a CTA,
# 13% of the kernel, no warpgroup overlapping it. On tests/ptx_sim.py the busiest thread of a 8192-entry split
# whose scores need every radix level runs 2545 instructions instead of 4648; on the GPU not measured yet (the
# device pool was paused): `HIST=1 bash benchmarks/run_gpu_pending.sh` times it. The "last" and "cluster" finals
# keep one warpgroup (their cross-CTA steps are written for 128 threads).
SELECT_WGS = (1, 2)
HIST_LAG = 3    # the converter counts block j - HIST_LAG after handing over block j: by then its store of block j
#                 waited for the scorer to release block j - cslots, so block j - 3's scores are usually stored.
#                 seg_ready has HIST_LAG + 1 slots: the scorer's block i + HIST_LAG + 1 needs the converter's
#                 iteration i + HIST_LAG + 1, past its wait for block i, so no slot's phase is overrun
#                 (tests/test_indexer_mosaic_protocol.py checks the protocol under random schedules).
# the profiled regions, per role (warpgroup 0 scores, warpgroup 1 converts fp4 blocks): per block, then once a CTA
PROFILE_REGIONS = {
    "scores": ("s_wait (the block's keys landed / its e5m2 slot converted)", "s_mma (wgmma issue and wait)",
               "s_epilogue (ReLU x weight, head sum, mask; the slot's release)",
               "s_hist (the streamed histogram and the pruned list, segment top-k only)",
               "s_wait_q (q and the weights, once)", "s_select (the split's selection after the last block, once)"),
    "converter": ("c_wait_keys (the block's packed keys landed)", "c_convert (nibbles -> e5m2 in registers)",
                  "c_wait_slot (the scorer released the e5m2 slot)", "c_store (the slot's stores, fence, arrive, "
                  "the next copy)"),
}
# ... and with profile_detail, split out of s_epilogue and c_store
PROFILE_DETAIL_REGIONS = {
    "scores": ("s_sync (the block's scores ordered for the histogram: seg_sync's barrier(s) / commit)",),
    "converter": ("c_commit (the async-proxy fence and barrier, the slot's arrival, the next key copy)",
                  "c_refill (conv_sync \"early\": the next key copy, issued after the conversion)"),
}
# ... and with seg_hist "converter", the converter's share of the histogram (the scorer then has no s_hist)
PROFILE_HIST_REGIONS = {
    "scores": ("s_wait_hist (the converter's histogram complete, once)",),
    "converter": ("c_wait_seg (the scorer's scores of block j - HIST_LAG stored)",
                  "c_hist (their streamed histogram)"),
}
# ... and with select_wgs 2, the converter's share of the selection (once a CTA)
PROFILE_SELECT_REGIONS = {"converter": ("c_select (the split's selection, with the scorer, once)",)}
PROFILE_ONCE = 8                  # ranges outside the block loop, with margin


FP4_TABLES = ("registers", "shared")
FP4_LAYOUTS = ("auto", "fragments", "rows")
FINALS = ("auto", "cluster", "triton", "last")


def profile_words_per_block(refill_region=False, hist_regions=False) -> int:
    """Profiler words a block and warpgroup: 4 regions (5 with profile_detail, 6 with it and refill_region: the
    kernel's conv_sync is "early"; 2 more with hist_regions: its converter counts the histogram), 2 records of 2
    words each."""
    detail = 0 if not MOSAIC_CONFIG["profile_detail"] else 2 if refill_region else 1
    return 4 * (4 + detail + (2 if hist_regions else 0))


def key_format(keys):
    """"fp8" or "bf16" (`gpu.key_format_of`) where this kernel takes the keys, else None."""
    from .gpu import key_format_of

    fmt = key_format_of(keys)
    return fmt if fmt in PRECISIONS else None


def _key_values(keys):
    return keys.values if isinstance(keys, formats.QuantizedKeys) else keys


def auto_takes(q, keys) -> bool:
    """kernel="auto"'s row / key count rule (the caller checks the rest): decode (<= MAX_QUERIES queries a row) over
    AUTO_FORMATS keys with >= MIN_ROWS query rows, or FEW_ROW_FORMATS keys whose rows hold >= MIN_KEY_BLOCKS
    128-key blocks in all."""
    fmt = key_format(keys)
    if fmt not in AUTO_FORMATS or q.shape[1] > MAX_QUERIES or not mosaic_applies(q, keys):
        return False
    rows = q.shape[0] * q.shape[1]
    return rows >= MIN_ROWS or (fmt in FEW_ROW_FORMATS and rows * -(-_key_values(keys).shape[1] // 128)
                                >= MIN_KEY_BLOCKS)


def fp4_q_operand(q, w, columns):
    """fp4 keys, q_prep "xla": a fake-quantized q [..., H, d] f32 and head weights w [..., H] -> (q_op [..., H, d]
    f16: each (token, head) divided by 2^e, e = frexp's exponent of its largest magnitude, its channels in the key
    operand's columns (`columns`: channel -> column, `mosaic_fp4.register_plan`); w x 2^e)."""
    amax = jnp.max(jnp.abs(q), axis=-1)
    e = jnp.where(amax > 0, jnp.frexp(amax)[1], 0)
    q_op = (q * jnp.ldexp(jnp.float32(1), -e)[..., None])[..., np.argsort(columns)].astype(jnp.float16)
    return q_op, w * jnp.ldexp(jnp.float32(1), e)


def fp4_q_operand_e5m2(q, w, columns):
    """fp4 keys at precision "fp8", q_prep "xla": q [..., H, d] f32 (raw or fake-quantized to fp4) and head weights
    w [..., H] -> (q_op [..., H, d] e5m2: `gpu.quantize_q_fp8` of q's fp4 fake quantization (exact while a head's
    groups span <= 28 binades), its channels in the e5m2 key operand's columns (`columns`, `mosaic_fp4.register_plan
    (.., "e5m2")`); w x its scale)."""
    from .gpu import quantize_q_fp8

    q_op, q_scale = quantize_q_fp8(formats.fake_quantize(q, "fp4"), "fp4")
    return q_op[..., np.argsort(columns)], w * q_scale


def quantizes_q(keys, precision=None) -> bool:
    """Whether the kernel makes q's quantization in the keys' format itself, so that a raw q gives the same operand
    (and scores) as a fake-quantized one: fp8 keys always (q's own fp8 quantization reproduces a fake-quantized q's
    values: re-quantizing one keeps its scale or halves it with the codes doubled, exactly), fp4 keys with
    precision "fp8" (its q operand starts with the fp4 fake quantization) or with MOSAIC_CONFIG q_prep "triton"
    (`q_prep.q_prep_fp4` fake-quantizes first; fp4 fake quantization is idempotent the same way). The dispatcher's
    `quantize_q` skips its own fake quantization on these paths. precision None: the format's default."""
    fmt = key_format(keys)
    if fmt in PRECISIONS:
        precision = precision or PRECISIONS[fmt][0]
    return fmt == "fp8" or (fmt == "fp4" and (precision == "fp8" or MOSAIC_CONFIG["q_prep"] in ("triton", "fused")))


def mosaic_applies(q, keys) -> bool:
    """Whether the kernel takes this call: fp8 or bf16 keys with head_dim 128, a key count T divisible by 8 (a tiled
    TMA box needs its array's dimension to be a multiple of the 8-row tile), at most 256 heads."""
    if key_format(keys) is None:
        return False
    vals = _key_values(keys)
    return q.shape[-1] == 128 and q.shape[-2] <= 256 and vals.ndim == 3 and vals.shape[1] % 8 == 0


def block_t_of(block_t, T):
    """The block_t a call runs with: the given one, else `default_config`'s."""
    return int(block_t) if block_t is not None else (128 if T > 64 else 64)


def default_config(R: int, T: int, fmt: str = "fp8"):
    """block_t 128 keys; fp8: 4 slots (16 KB of e4m3 each); bf16: 2 slots (32 KB each), so two CTAs fit an SM next
    to q's hi and lo (2 x 16 KB). On the H200 (session 27, B = 64 x 128K, scores us) bf16 at 128 x 2 slots took
    155.8, 64 x 4 161.2, 64 x 6 (one CTA per SM) 189.9, 128 x 3 (one CTA per SM) 172.8. Splits for ~TARGET_CTAS CTAs
    of >= MIN_BLOCKS blocks."""
    block_t = block_t_of(None, T)
    nb = -(-T // block_t)
    return dict(block_t=block_t, num_stages=2 if fmt == "bf16" else 4,
                num_splits=max(1, min(-(-nb // MIN_BLOCKS), TARGET_CTAS // max(R, 1))))


SELECT_WAVE_GAIN = 0.1   # the least gain `select_splits`' estimate must promise over the fewest splits


def select_splits(R: int, nb: int, min_splits: int) -> int:
    """The segment top-k's split count where R rows x min_splits CTAs pass one wave (TARGET_CTAS, two CTAs an SM):
    of min_splits .. 2 min_splits, the one with the fewest waves x blocks a split (each split's segment must fit its
    shared memory, hence the floor; more splits leave more survivors for the final), if it promises SELECT_WAVE_GAIN
    over min_splits. H100, 128K context (session 57, own us): B = 80 fp4 4 splits 129.6, 6 113.6, 8 111.8 (this rule:
    6); B = 100 fp4 4 164.8, 5 132.4, 6 136.9 (5), fp8 5 168.5, 6 194.2; B = 128 4 166.8, 6 168.2 (4)."""
    if R * min_splits <= TARGET_CTAS:
        return min_splits
    est = {ns: -(-R * ns // TARGET_CTAS) * -(-nb // ns) for ns in range(min_splits, 2 * min_splits + 1)}
    best = min(est, key=est.get)
    return best if est[best] <= (1.0 - SELECT_WAVE_GAIN) * est[min_splits] else min_splits


def launch_layout(R: int, T: int, fmt: str, *, block_t=None, num_stages=None, num_splits=None, select=False,
                  converter=0):
    """A call's (block_t, num_stages, nb blocks of keys, bps blocks a split, n_split splits): `default_config`'s,
    with select (select_k) at most SELECT_CONFIG's stages and enough splits for its max_segment; the options given
    override. converter (fp4_converter's slots) with select: at most 2 key slots where 2+ e5m2 slots would not let
    two CTAs share an SM (the segment top-k's ~82 KB a CTA with 3 fp4 slots, + 16.5 KB an e5m2 slot: 2 x (115.8 KB
    + 1 KB reserved) > 228 KB; 2 key slots: 107.1 KB)."""
    cfg = default_config(R, T, fmt)
    if select:
        cfg["num_stages"] = min(cfg["num_stages"], SELECT_CONFIG["num_stages"])
        if SELECT_CONFIG["prune"]:
            cfg["num_stages"] = min(cfg["num_stages"], SELECT_CONFIG["prune_stages"])
        if converter >= 2:
            cfg["num_stages"] = min(cfg["num_stages"], 2)
        cfg["num_splits"] = max(cfg["num_splits"], -(-T // SELECT_CONFIG["max_segment"]))
        if num_splits is None:
            cfg["num_splits"] = select_splits(R, -(-T // cfg["block_t"]), cfg["num_splits"])
    for k_, v_ in dict(block_t=block_t, num_stages=num_stages, num_splits=num_splits).items():
        if v_ is not None:
            cfg[k_] = int(v_)
    bt, stages = cfg["block_t"], cfg["num_stages"]
    if bt not in (64, 128, 192, 256):
        raise ValueError(f"block_t must be 64, 128, 192 or 256 (the wgmma M of one warpgroup), got {bt}")
    if not 1 <= stages <= 8:
        raise ValueError(f"num_stages must be in [1, 8], got {stages}")
    nb = -(-T // bt)
    bps = -(-nb // max(1, min(cfg["num_splits"], nb)))
    return bt, stages, nb, bps, -(-nb // bps)


def _store_rows_plain(vals, ref):
    """In a Mosaic GPU kernel: vals ([m] in the WGMMA row layout) into ref ([m] in shared memory) as plain stores,
    without the warpgroup barriers Pallas' `ref[...] = v` puts before and after (the caller orders them)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA.reduce(1), plgpu.RefType()))
    def store(_, v, r):
        v.store_untiled(r)

    store(vals, ref)


def _fence_async_shared():
    """In a Mosaic GPU kernel: this thread's shared-memory writes ordered before later async-proxy reads (wgmma,
    TMA) that a barrier orders after it: `commit_smem` without its warpgroup barrier."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from jax._src.lib.mlir.dialects import nvvm

    @plgpu.inline_mgpu()
    def fence(_):
        nvvm.fence_proxy(nvvm.ProxyKind.async_shared, space=nvvm.SharedSpace.shared_cta)

    fence()


def _warpgroup_barrier():
    """In a Mosaic GPU kernel: the warpgroup's named barrier alone (`commit_smem` without its async-proxy fence):
    orders shared-memory accesses among the warpgroup's threads."""
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    from jax.experimental.pallas import mosaic_gpu as plgpu

    @plgpu.inline_mgpu()
    def bar(_):
        mgpu_utils.warpgroup_barrier()

    bar()


def region(name, detail_of=None):
    """A named profiler region (`PROFILE_REGIONS`) around the ops traced inside it: with MOSAIC_CONFIG["profile"]
    Pallas' Mosaic GPU lowering opens a range where the ops' name stack gains the name and closes it where the name
    leaves; without a profiler it emits nothing. Ops of a nested jaxpr (a loop body, pl.when, run_scoped) start a
    name stack of their own, so a region wraps either the nested call or ops inside its body, not both. detail_of: a
    region of `PROFILE_DETAIL_REGIONS`, recorded as itself with MOSAIC_CONFIG["profile_detail"], else as part of
    detail_of (adjacent ops of one name make one range)."""
    return jax.named_scope(name if detail_of is None or MOSAIC_CONFIG["profile_detail"] else detail_of)


def _kernel(*refs, converter=0, shared_tables=False, rows_layout=False, hist_conv=False, **kw):
    """The kernel; with converter (fp4_converter's slots) two warpgroups: wg 1 converts the fp4 blocks into e5m2
    slots in shared memory (`_kernel_body(role="converter")`), wg 0 scores them (role "scores"). The converter's
    scratch is the last refs: e5m2 slots [converter, bt, 128], key factors [converter, bt] f32, the slots' full /
    empty barriers, with shared_tables (fp4_tables "shared") the keys' tables [8, bt] int32, and with hist_conv
    (seg_hist "converter") the blocks' seg_ready barriers [HIST_LAG + 1] and hist_done."""
    if not converter:
        return _kernel_body(*refs, **kw)
    n_conv = (5 if shared_tables else 4) + (2 if hist_conv else 0)
    refs, conv = refs[:-n_conv], refs[-n_conv:]
    if hist_conv:
        conv, hist_bars = conv[:-2], conv[-2:]
        kw = dict(kw, hist_bars=hist_bars)
    wg = jax.lax.axis_index("wg")
    pl.when(wg == 1)(lambda: _kernel_body(*refs, conv=conv, role="converter", rows_layout=rows_layout, **kw))
    pl.when(wg == 0)(lambda: _kernel_body(*refs, conv=conv, role="scores", **kw))


def _fp4_e5m2_values(packed, scale_words, rows_order=False):
    """The interpreter's model of `mosaic_fp4.fp4_operand(.., "e5m2")` (jnp, no register layouts; no captured
    constants, which a Mosaic GPU kernel body may not hold): packed [rows, 64] uint8, scale_words [rows] int32 (a
    key's 4 ue8m0 bytes) -> (e5m2 [rows, 128]: channel c's e2m1 x 2^(13 - D) in column `register_plan(64, "e5m2")`
    [c], 0 where D > E5M2_MAX_D; f32 [rows]: 2^(smax - 140)), the values the inline PTX produces. rows_order
    (fp4_layout "rows", `mosaic_fp4.fp4_operand_rows`): channel c in column c."""
    from .mosaic_fp4 import E5M2_MAX_D, e5m2_factor_bits

    rows = packed.shape[0]
    p = packed.astype(jnp.int32)
    nib = jnp.stack([p & 0xF, p >> 4], axis=-1).reshape(rows, 128)          # channel 2i = low nibble of byte i
    e, m = (nib >> 1) & 3, (nib & 1).astype(jnp.float32)
    mag = jnp.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * jnp.left_shift(1, e).astype(jnp.float32) * 0.5)
    s = jnp.stack([(scale_words >> (8 * g)) & 0xFF for g in range(4)], axis=-1)   # [rows, 4]
    smax = jnp.max(s, axis=-1)
    d = jnp.broadcast_to((smax[:, None] - s)[:, :, None], (rows, 4, 32)).reshape(rows, 128)   # D per channel
    fac = jax.lax.bitcast_convert_type((jnp.clip(13 - d, -126, 127) + 127) << 23, jnp.float32)   # 2^(13 - D)
    val = jnp.where(d <= E5M2_MAX_D, mag * fac, 0.0)                                 # exact
    val = jnp.where(nib >= 8, -val, val)          # the sign bit even on a zero (dropped groups too), as the asm
    if rows_order:
        return val.astype(jnp.float8_e5m2), jax.lax.bitcast_convert_type(e5m2_factor_bits(smax, jnp), jnp.float32)
    # the register plan's column order: within each 32-channel group, the channel index's bits of value 4 and 16
    # trade places (tests/test_indexer_mosaic_fp4.py places the asm model's bytes by register_plan and compares)
    val = val.reshape(rows, 4, 2, 2, 2, 4).transpose(0, 1, 4, 3, 2, 5).reshape(rows, 128).astype(jnp.float8_e5m2)
    return val, jax.lax.bitcast_convert_type(e5m2_factor_bits(smax, jnp), jnp.float32)


def _convert_blocks(n_read, stages, cslots, issue, refill, k_smem, s_smem, k_bars, conv_smem, kf_smem, conv_full,
                    conv_empty, interpret, tables_smem=None, rows_layout=False, conv_sync="commit", hist=None,
                    hist_done=None):
    """fp4_converter's wg 1: streams the split's n_read fp4 blocks through the key ring (`issue` the first `stages`,
    `refill(j)` block j's slot with block j + stages)
    and converts block j into e5m2 slot j % cslots (+ its keys' score factors) once the scoring warpgroup has
    released that slot's previous block (conv_empty), then marks it full. Invariants: a slot is written only after
    its previous block's wgmma completed (conv_empty); the consumer's wgmma reads it only after every converter
    thread's stores were fenced for the async proxy (commit_smem) and arrived (conv_full); a key slot is refilled
    only after every converter thread has read it (commit_smem's warpgroup barrier). tables_smem ([8, bt] int32,
    fp4_tables "shared"): each key's e5m2 tables built once (thread t: key t), stored, and read back by the 4
    threads that hold its row (`mosaic_fp4.e5m2_tables_by_row`), instead of built by each of them. rows_layout
    (fp4_layout "rows"): a thread converts whole rows (`mosaic_fp4.fp4_operand_rows`), channel c into column c.
    conv_sync "arrive" (MOSAIC_CONFIG): each thread fences its own stores and arrives, no warpgroup barrier, and the
    scoring warpgroup issues the key slot's next copy once conv_full completed (`_kernel_body`): the full barrier's
    128 arrivals, each after that thread's reads of the key slot, order every read before the copy. The interpreter
    (no inline asm) keeps commit_smem's barrier there but the same hand-over of the copies. hist (seg_hist
    "converter"): hist(i) counts block i's scores into the selection's histogram (waiting for them), called for
    block j - HIST_LAG after block j's hand-over and for the last HIST_LAG blocks after the loop; then the arrival
    on hist_done (the histogram is complete: the scorer may select)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    for j in range(stages):
        pl.when(j < n_read)(functools.partial(issue, j))
    row_layout = plgpu.Layout.WGMMA.reduce(1)

    def body(j, carry):
        slot, cslot = j % stages, j % cslots
        with region("c_wait_keys"):
            plgpu.barrier_wait(k_bars.at[slot])
        with region("c_convert"):
            vals, factor = convert(slot)
        if conv_sync == "early":   # block j's keys are in registers: the slot's next copy now (its warpgroup
            with region("c_refill", detail_of="c_convert"):   # barrier orders every thread's reads before it)
                refill(j)

        @pl.when(j >= cslots)   # the scoring warpgroup is done with block j - cslots in this slot
        def _():
            with region("c_wait_slot"):
                plgpu.barrier_wait(conv_empty.at[cslot])

        with region("c_store"):
            store(cslot, vals, factor)
        with region("c_commit", detail_of="c_store"):
            if conv_sync != "commit" and not interpret:   # this thread's stores, for the wgmma's async-proxy reads
                _fence_async_shared()
            else:   # ... and with "commit", every thread past the key slot's reads (the converter refills it)
                plgpu.commit_smem()
            plgpu.barrier_arrive(conv_full.at[cslot])
            if conv_sync == "commit":   # "arrive": the scorer issues the copy once conv_full completes; "early": done
                refill(j)
        if hist is not None:   # the scorer's scores of block j - HIST_LAG into the selection's histogram
            pl.when(j >= HIST_LAG)(lambda: hist(j - HIST_LAG))
        return carry

    def convert(slot):   # block `slot` of the key ring -> (e5m2 values, the keys' score factors) in registers
        if interpret:
            vals, factor = _fp4_e5m2_values(k_smem.at[slot][...], s_smem.at[slot][...], rows_order=rows_layout)
        elif rows_layout:
            from .mosaic_fp4 import fp4_operand_rows, rows_pallas_layout

            bt = s_smem.shape[1]
            vals, factor = fp4_operand_rows(
                plgpu.load(k_smem.at[slot], (), layout=rows_pallas_layout(64)),
                plgpu.load(s_smem.at[slot], (), layout=plgpu.Layout.WG_STRIDED((bt,), vec_size=1)))
        elif tables_smem is not None:
            from .mosaic_fp4 import e5m2_tables_by_row, fp4_operand

            bt = s_smem.shape[1]
            *words, factor = e5m2_tables_by_row(
                plgpu.load(s_smem.at[slot], (), layout=plgpu.Layout.WG_STRIDED((bt,), vec_size=1)))
            # (every thread's reads of the previous block's tables ended before that block's closing commit_smem)
            for k, word in enumerate(words):
                tables_smem.at[k][...] = word
            plgpu.commit_smem()   # a warpgroup barrier: every key's tables are in place
            tables = [plgpu.load(tables_smem.at[k], (), layout=row_layout) for k in range(8)]
            vals = fp4_operand(plgpu.load(k_smem.at[slot], (), layout=plgpu.Layout.WGMMA_UPCAST_2X), None, "e5m2",
                               tables=tables)
        else:
            from .mosaic_fp4 import fp4_operand

            vals, factor = fp4_operand(plgpu.load(k_smem.at[slot], (), layout=plgpu.Layout.WGMMA_UPCAST_2X),
                                       plgpu.load(s_smem.at[slot], (), layout=row_layout), "e5m2")
        return vals, factor

    def store(cslot, vals, factor):
        if rows_layout and not interpret:   # plain stores: no automatic barriers around them (`store_rows_slot`)
            from .mosaic_fp4 import store_rows_slot

            store_rows_slot(vals, factor, conv_smem.at[cslot], kf_smem.at[cslot])
        else:
            conv_smem.at[cslot][...] = vals
            kf_smem.at[cslot][...] = factor

    jax.lax.fori_loop(0, n_read, body, 0)
    if hist is not None:   # the last HIST_LAG blocks' histograms, then the scorer may select
        def hist_tail(i, carry):
            hist(i)
            return carry

        jax.lax.fori_loop(jnp.maximum(n_read - HIST_LAG, 0), n_read, hist_tail, 0)
        plgpu.barrier_arrive(hist_done)

    def drain(j, carry):   # the last blocks' releases: every phase of conv_empty observed before the kernel ends
        plgpu.barrier_wait(conv_empty.at[j % cslots])
        return carry

    jax.lax.fori_loop(jnp.maximum(n_read - cslots, 0), n_read, drain, 0)


def _kernel_body(*refs, T, bt, stages, bps, nb, S, precision, convert="cvt", n_phase=0, split_m=False,
                 fp4=False, select=None, epilogue="full", interpret=False, conv=None, role="scores",
                 rows_layout=False, seg_sync="commit", conv_sync="commit", hist_bars=None, q_fused=False):
    """nv [R] i32, w [R, H] f32, q [R, H, 128] e4m3 (f16 codes with "f16"; for bf16 keys bf16 [R, terms * H, 128],
    the terms stacked along the heads), keys [B, T, 128] e4m3 or bf16, scales [B*T] f32 (fp8 keys only)
    -> out [R, nb*bt]. Interpreted, q is transposed: [R, 128, H] / [R, terms, 128, H]. fp4: keys [B, T, 64] uint8
    (packed e2m1), scales [B*T] int32 (a key's 4 ue8m0 bytes), q [R, H, 128] f16 in `mosaic_fp4`'s column order.
    select = dict(k, slots, aggregate, stream_hist, cluster, last, prune, probe): no scores out; the split's scores stay in shared
    memory as u keys (seg int32 [>= bps * bt], `mosaic_select`) and the CTA selects their top-k superset: into out
    [R, n_split, slots] (keys) and pos [R, n_split, slots], or with cluster (grid (R,), cluster (n_split,)) CTA 0 of
    the row selects the row's exact set among the splits' survivors into out [R, k] (`as_index_set`'s layout). With
    last, the outputs are (set [R, k], keys, pos) and the split CTA that writes its survivors last selects the row's
    set among them (`mosaic_select.last_final`, a per-row arrival counter in a zeroed GMEM semaphore array). With
    prune (the candidate list's capacity, idx [prune] int32 scratch), `mosaic_select.prune_*` (SELECT_CONFIG).
    hist_bars (seg_hist "converter", fp4 converter only): (seg_ready [HIST_LAG + 1], hist_done) barriers; the
    converter counts the streamed histogram instead of the scorer (MOSAIC_CONFIG's note). q_fused (q_prep "fused":
    fp4 keys at "fp8" in the rows layout, fp8 keys with convert "cvt"): q arrives raw, [R, H, 128] f32 with w
    [R, H] f32, and the scorer makes its row's codes (into q_smem) and weights (into w_smem) itself (`_prepare_q`)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    f16 = precision == "f16"
    refs = list(refs)
    gm_smem = gi_smem = gmax_ref = seg_smem = sel_smem = pos_ref = None
    idx_smem = None
    if select and select["prune"]:   # the pruned selection's candidate list
        refs, idx_smem = refs[:-1], refs[-1]
    if select:   # the split's scores, and the selection's histogram + exchange words
        refs, (seg_smem, sel_smem) = refs[:-2], refs[-2:]
    if n_phase:   # the group maxima's running f32 values and their ordered-int32 copy for the store
        refs, (gm_smem, gi_smem) = refs[:-2], refs[-2:]
    if precision in PRECISIONS["bf16"]:   # bf16 keys: no scales
        (nv_ref, w_ref, q_ref, key_ref), refs = refs[:4], refs[4:]
        scale_ref = None
    else:
        (nv_ref, w_ref, q_ref, key_ref, scale_ref), refs = refs[:5], refs[5:]
    set_ref = None
    if select and select["last"]:   # the row's set, then the survivors (as without "last")
        set_ref, refs = refs[0], refs[1:]
    out_ref, refs = refs[0], refs[1:]
    if select and not select["cluster"]:
        pos_ref, refs = refs[0], refs[1:]
    if n_phase:
        gmax_ref, refs = refs[0], refs[1:]
    if scale_ref is None:
        q_smem, w_smem, k_smem, o_smem, fill_smem, q_bar, k_bars = refs
        s_smem = None
    else:
        q_smem, w_smem, k_smem, s_smem, o_smem, fill_smem, q_bar, k_bars = refs

    r = jax.lax.axis_index("r")
    split = jax.lax.axis_index("s")
    if select and select["stream_hist"] and role == ("scores" if hist_bars is None else "converter"):
        from .mosaic_select import hist_zero

        hist_zero(sel_smem, wg_local=hist_bars is not None)
    b = r // S
    base = b * T                                      # the row's first key in the flat scale array
    nv = jnp.clip(nv_ref[r], 0, T)
    lo = split * bps
    hi = jnp.minimum(lo + bps, nb)
    n_read = jnp.clip((nv + bt - 1) // bt - lo, 0, hi - lo)   # this split's blocks with any visible key
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    col_layout = plgpu.Layout.WGMMA.reduce(0)

    def load(ref, layout):   # the interpreter has no register layouts (nor plgpu.load / layout_cast)
        return ref[...] if interpret else plgpu.load(ref, (), layout=layout)

    def cast(x, layout):
        return x if interpret else plgpu.layout_cast(x, layout)

    def issue(j):   # block lo + j into slot j % stages
        slot = j % stages
        t0 = pl.multiple_of((lo + j) * bt, bt)
        plgpu.copy_gmem_to_smem(key_ref.at[b, pl.ds(t0, bt)], k_smem.at[slot], k_bars.at[slot])
        if scale_ref is not None:
            plgpu.copy_gmem_to_smem(scale_ref.at[pl.ds(base + t0, bt)], s_smem.at[slot], k_bars.at[slot])

    def refill(j):   # block j's key slot gets block j + stages, where the split has it
        pl.when(j + stages < n_read)(lambda: issue(j + stages))

    def select_split(out0, out1, **opts):   # the plain selection of this split's n_read blocks (scores past them
        from . import mosaic_select as ms      # hold no candidate), by select["threads"] threads; with 256 both
        #                                        warpgroups call it, so every argument comes from `select` alike
        ms.segment_select(seg_smem, sel_smem, n_read * bt, lo * bt, out0, out1, k=select["k"], slots=select["slots"],
                          aggregate=select["aggregate"], hist_ready=select["stream_hist"], threads=select["threads"],
                          **opts)

    if conv is not None:   # fp4_converter: e5m2 slots, their key factors, full (converted) / empty (scored) barriers
        conv_smem, kf_smem, conv_full, conv_empty = conv[:4]
        cslots = conv_smem.shape[0]
    if role == "converter":   # wg 1: the key ring's copies, and every block converted into an e5m2 slot
        hist = hist_done = None
        if hist_bars is not None:   # ... and the scorer's scores counted into the selection's first level
            from .mosaic_select import hist_block

            seg_ready, hist_done = hist_bars

            def hist(i):   # block i's scores, once the scorer handed them over
                with region("c_wait_seg"):
                    plgpu.barrier_wait(seg_ready.at[i % (HIST_LAG + 1)])
                with region("c_hist"):
                    hist_block(seg_smem, sel_smem, i * bt, bt=bt, aggregate=select["aggregate"], wg_local=True)

        _convert_blocks(n_read, stages, cslots, issue, refill, k_smem, s_smem, k_bars, conv_smem, kf_smem,
                        conv_full, conv_empty, interpret, tables_smem=conv[4] if len(conv) > 4 else None,
                        rows_layout=rows_layout, conv_sync=conv_sync, hist=hist, hist_done=hist_done)
        if select and select["threads"] == 256:   # select_wgs 2: the split's selection with the scorer
            with region("c_select"):
                select_split(out_ref.at[r, split], pos_ref.at[r, split])
        return
    if not q_fused:
        plgpu.copy_gmem_to_smem(q_ref.at[r], q_smem, q_bar)
        plgpu.copy_gmem_to_smem(w_ref.at[r], w_smem, q_bar)
    for j in range(stages if conv is None else 0):   # the converter warpgroup issues the key copies
        @pl.when(j < n_read)
        def _(j=j):
            issue(j)

    fill_smem[...] = cast(jnp.full((bt,), -jnp.inf, jnp.float32), row_layout)
    for p in range(n_phase):
        gm_smem.at[p][...] = cast(jnp.full((bt,), -jnp.inf, jnp.float32), row_layout)
    with region("s_wait_q"):
        if q_fused:   # the row's q straight from global memory into registers, its codes and weights made here
            _prepare_q(q_ref.at[r], w_ref.at[r], q_smem, w_smem, interpret, "fp4" if fp4 else precision)
        else:
            plgpu.barrier_wait(q_bar)
    w = load(w_smem, col_layout)
    # [128, H], K-major as fp8 operands must be (the interpreter's wgmma takes no transposed ref: q arrives [128, H])
    transpose = (lambda ref: ref) if interpret else (lambda ref: plgpu.transpose_ref(ref, (1, 0)))
    H = w_smem.shape[0]
    if scale_ref is None:   # bf16 keys: q's terms (hi, lo) score into one accumulator; [terms * H, 128] (compiled)
        q_ts = ([q_smem.at[i] for i in range(q_smem.shape[0])] if interpret else
                [transpose(q_smem.at[pl.ds(i * H, H)]) for i in range(q_smem.shape[0] // H)])
    else:
        q_t = transpose(q_smem)

    def store(j, vals_smem):   # the block's scores (a [bt] smem vector, committed) to global memory
        plgpu.copy_smem_to_gmem(vals_smem, out_ref.at[r, pl.ds(pl.multiple_of((lo + j) * bt, bt), bt)])

    def a_operand(slot, rows):   # the A operand of the block's keys `rows` (a pl.ds) for precision "f16" / others
        if fp4:   # packed e2m1 + group scales -> f16 (or e5m2, precision "fp8") registers, and each key's factor
            from .mosaic_fp4 import fp4_operand

            return fp4_operand(load(k_smem.at[slot, rows], plgpu.Layout.WGMMA_UPCAST_2X),
                               load(s_smem.at[slot, rows], plgpu.Layout.WGMMA.reduce(1)),
                               "f16" if f16 else "e5m2", raw=convert == "raw")
        if not f16:
            return k_smem.at[slot, rows]
        # e4m3 codes -> f16 in registers (exact), the wgmma's A operand from registers
        a8 = load(k_smem.at[slot, rows], plgpu.Layout.WGMMA_UPCAST_2X)
        a16 = a8.astype(jnp.float16) if convert == "cvt" else _e4m3_to_f16(a8, convert)
        return cast(a16, plgpu.Layout.WGMMA)

    def mma(acc_ref, slot, rows):   # -> fp4: the keys' score factors [rows], else None
        if conv is not None:   # fp4_converter: slot is the e5m2 slot, converted and committed by wg 1
            plgpu.wgmma(acc_ref, conv_smem.at[slot, rows], q_t)
            return load(kf_smem.at[slot, rows], row_layout)
        if fp4:
            a16, key_factor = a_operand(slot, rows)   # already in the WGMMA layout
            plgpu.wgmma(acc_ref, a16, q_t)
            return key_factor
        if f16 or scale_ref is not None:
            plgpu.wgmma(acc_ref, a_operand(slot, rows), q_t)
        else:   # bf16 keys, q's terms in turn: K (q_hi + q_lo)^T
            for q_term in q_ts:
                plgpu.wgmma(acc_ref, k_smem.at[slot, rows], q_term)

    # seg_sync "barrier": the converter path under the segment top-k (compiled): the scorer's only shared-memory
    # writes a block are its scores, read by its own threads; the slot goes back by conv_empty
    plain_seg = bool(select) and conv is not None and not interpret and (seg_sync == "barrier" or bool(hist_bars))

    def finish(j, slot, logits, r0, m, o, key_factor=None):   # rows [r0, r0 + m) of block j: scores into o,
        rl = row_layout                                          # the group maxima
        if epilogue == "probe":   # timing probe, wrong values: the first 8 heads' logits summed, no ReLU or weight
            s = jnp.sum(logits[:, :8], axis=1)
        else:
            s = jnp.sum(jnp.maximum(logits, 0.0) * jax.lax.broadcast_in_dim(w, (m, H), (1,)), axis=1)
        if key_factor is not None:   # fp4 keys: 2^(the key's largest group scale - 128 (f16) / - 140 (e5m2))
            s = s * key_factor
        elif s_smem is not None:   # fp8 keys: the key's power-of-two scale
            s = s * load(s_smem.at[slot, pl.ds(r0, m)], rl)
        t = (lo + j) * bt + r0 + plgpu.broadcasted_iota(jnp.int32, (m,), 0, layout=None if interpret else rl)
        s = jnp.where(t < nv, s, -jnp.inf)
        if select:   # the selection's u keys: ordered int32 ^ 2^31 (unsigned order = float total order)
            from .topk import _ordered_i32

            u = _ordered_i32(s) ^ jnp.int32(-(2 ** 31))
            if plain_seg:   # ordered by the warpgroup barrier after the block (seg_sync "barrier")
                _store_rows_plain(u, o.at[pl.ds(r0, m)])
            else:
                o.at[pl.ds(r0, m)][...] = u
            return
        if n_phase:   # key t is in strided group t mod (n_phase * bt): this block's keys fill phase (lo + j) % n_phase
            g = gm_smem.at[(lo + j) % n_phase, pl.ds(r0, m)]
            g[...] = jnp.maximum(load(g, rl), s)
        o.at[pl.ds(r0, m)][...] = s

    def body(j, carry):
        slot = j % stages
        if select:   # block j's scores stay in the segment buffer
            o = seg_smem.at[pl.ds(pl.multiple_of(j * bt, bt), bt)]
        else:
            o = o_smem.at[j % 2]
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)   # the store that last read this output slot is done
        with region("s_wait"):
            if conv is None:
                plgpu.barrier_wait(k_bars.at[slot])
            else:   # block j converted into e5m2 slot j % cslots
                slot = j % cslots
                plgpu.barrier_wait(conv_full.at[slot])
                if conv_sync == "arrive":   # every converter thread is past block j's key slot: its next copy
                    refill(j)
        if split_m:   # two [bt / 2, H] accumulators: half 1's operand and wgmma overlap half 0's, half 0's
            h = bt // 2   # epilogue overlaps half 1's wgmma
            def halves(acc0, acc1):
                f0 = mma(acc0, slot, pl.ds(0, h))
                f1 = mma(acc1, slot, pl.ds(h, h))
                finish(j, slot, plgpu.wgmma_accumulator_load(acc0, wait_n=1), 0, h, o, f0)
                finish(j, slot, plgpu.wgmma_accumulator_load(acc1, wait_n=0), h, h, o, f1)

            pl.run_scoped(halves, plgpu.ACC((h, H), jnp.float32), plgpu.ACC((h, H), jnp.float32))
        else:
            def whole(acc_ref):
                key_factor = mma(acc_ref, slot, pl.ds(0, bt))
                return acc_ref[...], key_factor

            with region("s_mma"):
                logits, key_factor = pl.run_scoped(whole, plgpu.ACC((bt, H), jnp.float32))
            with region("s_epilogue"):
                if conv is not None:   # the wgmma is done (the accumulator read waits) and the factors are loaded
                    plgpu.barrier_arrive(conv_empty.at[slot])
                finish(j, slot, logits, 0, bt, o, key_factor)
        with region("s_sync", detail_of="s_epilogue"):
            if hist_bars is not None:   # the block's scores to the converter, which counts them (release / acquire)
                plgpu.barrier_arrive(hist_bars[0].at[j % (HIST_LAG + 1)])
            elif plain_seg:   # the block's scores visible to every thread of the warpgroup (the histogram's reads)
                _warpgroup_barrier()
            else:
                plgpu.commit_smem()   # also a warpgroup barrier: every thread is past this slot's keys and scales
        with region("s_hist"):
            stream_and_prune(j, o)
        return carry

    def stream_and_prune(j, o):   # after block j's scores: the streamed histogram, the next copy, the pruned list
        prune_j = bps // 2 - 1   # pruning: the threshold after this block (the split's first half)
        if select and select["stream_hist"] and hist_bars is None:   # this block's keys into the first level
            from .mosaic_select import hist_block

            count = functools.partial(hist_block, seg_smem, sel_smem, j * bt, bt=bt, aggregate=select["aggregate"])
            if select["prune"]:   # the threshold needs the first half's counts only
                pl.when(j <= prune_j)(count)
            else:
                count()

        if conv is None:   # else the converter (conv_sync "commit") or the scorer's wait above refills the key ring
            refill(j)

        if select and select["prune"]:   # after the next block's copy is issued: the threshold, then candidates
            from . import mosaic_select as ms

            @pl.when(j == prune_j)
            def _():
                ms.prune_start(seg_smem, sel_smem, (prune_j + 1) * bt, idx_smem, k=select["k"], cap=select["prune"])

            @pl.when(j > prune_j)
            def _():
                ms.prune_append(seg_smem, sel_smem, j * bt, idx_smem, bt=bt, cap=select["prune"])

        if not select:
            store(j, o)

    def select_tail():   # the split's blocks past n_visible hold no candidate: the selection looks at n_read blocks
        from . import mosaic_select as ms

        k_sel, slots = select["k"], select["slots"]
        if select["probe"] == 1:
            return
        if select["probe"] == 2:   # the selection up to its compaction (a timing probe)
            select_split(out_ref.at[r, split], pos_ref.at[r, split], compact=False)
            return
        select_one = select_split
        if select["prune"]:   # over the candidate list, or the whole split (`mosaic_select.prune_final_ptx`)
            select_one = functools.partial(ms.prune_select, seg_smem, sel_smem, n_read * bt, lo * bt, k=k_sel,
                                           slots=slots, aggregate=select["aggregate"], idx_smem=idx_smem)
        if not select["cluster"]:
            select_one(out_ref.at[r, split], pos_ref.at[r, split])
            if select["last"]:   # the split CTA that finishes last selects the row's set among every split's survivors
                counters = pl.get_global(plgpu.SemaphoreType.REGULAR((out_ref.shape[0],)))   # zero at launch
                ms.last_final(seg_smem, sel_smem, counters, out_ref.at[r], pos_ref.at[r], set_ref.at[r], r,
                              n_split=out_ref.shape[1], slots=slots, k=k_sel)
            return
        # survivors (u, position) into this CTA's scratch; CTA 0 of the cluster gathers every split's into its
        # segment buffer (u at [0, W), positions at [W, 2W)) and selects the row's set among them
        surv_u, surv_pos = sel_smem.at[pl.ds(0, slots)], sel_smem.at[pl.ds(slots, slots)]
        select_one(surv_u, surv_pos, out="smem_pairs")
        n_split = select["cluster"]
        W = n_split * slots
        ms.cluster_sync()

        @pl.when(split == 0)
        def _():
            ms.gather(surv_u, surv_pos, seg_smem.at[pl.ds(0, W)], seg_smem.at[pl.ds(W, W)], n_split=n_split,
                      slots=slots)

        ms.cluster_sync()   # every CTA's survivors are read: the others may end

        @pl.when(split == 0)
        def _():
            ms.segment_select(seg_smem, sel_smem, jnp.int32(W), seg_smem.at[pl.ds(W, W)], out_ref.at[r], k=k_sel,
                              slots=k_sel,
                              pos_in="smem", out="global_set", aggregate=select["aggregate"])
        return

    jax.lax.fori_loop(0, n_read, body, 0)
    plgpu.commit_smem()
    if select:
        if hist_bars is not None:   # the converter counted every block
            with region("s_wait_hist"):
                plgpu.barrier_wait(hist_bars[1])
        with region("s_select"):
            select_tail()
        return

    def fill(j, carry):   # blocks of this split past n_visible: -inf, keys unread
        store(j, fill_smem)
        return carry

    jax.lax.fori_loop(n_read, hi - lo, fill, 0)
    if n_phase:   # the split's partial maxima as ordered int32 keys (signed order = float order)
        from .topk import _ordered_i32

        for p in range(n_phase):
            gi_smem.at[p][...] = _ordered_i32(load(gm_smem.at[p], row_layout))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(gi_smem, gmax_ref.at[r, split])
    plgpu.wait_smem_to_gmem(0)


def _prepare_q(q_row, w_row, q_smem, w_smem, interpret, operand):
    """q_prep "fused": q_row [H, 128] f32 (global), w_row [H] f32 (global) -> q_smem [H, 128] (interpreted: [128, H])
    and w_smem [H] f32, the Triton q kernel's values bit for bit: operand "fp4" (fp4 keys at precision "fp8": e5m2
    codes, `q_prep.fp4_q_operand_e5m2_rows`), "f16" / "fp8" (fp8 keys at that precision: e4m3 codes as f16 or e4m3,
    `q_prep.fp8_q_operand_rows`); then fenced for the wgmma's async-proxy reads and ordered for every thread's loads
    (commit_smem). Compiled, q loads into the WGMMA layout (H a multiple of 64) from global memory directly (an
    unoptimized transfer: 64 values a thread, once a CTA), so no shared memory is staged for it."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from .q_prep import fp4_q_operand_e5m2_rows, fp8_q_operand_rows

    def make(q, w, column=None):
        if operand == "fp4":
            return fp4_q_operand_e5m2_rows(q, w, column)
        return fp8_q_operand_rows(q, w, f16=operand == "f16")

    if interpret:
        codes, w = make(q_row[...], w_row[...])
        q_smem[...] = codes.T
    else:
        layout = plgpu.Layout.WGMMA
        q = plgpu.load(q_row, (), layout=layout, optimized=False)
        column = plgpu.broadcasted_iota(jnp.int32, q.shape, 1, layout=layout)
        codes, w = make(q, plgpu.load(w_row, (), layout=layout.reduce(1), optimized=False), column)
        q_smem[...] = codes
    w_smem[...] = w
    plgpu.commit_smem()


def _config_choice(name, choices):
    """MOSAIC_CONFIG[name], which must be one of choices (else a ValueError that names them)."""
    value = MOSAIC_CONFIG[name]
    if value not in choices:
        raise ValueError(f"MOSAIC_CONFIG[{name!r}] must be one of {choices}, got {value!r}")
    return value


def profile_params(blocks_per_split, interpret=False, **regions) -> dict:
    """plgpu.kernel's compiler_params where MOSAIC_CONFIG["profile"] names a directory (compiled kernels only), else
    {}: room for every region the kernel records a block (`profile_words_per_block(**regions)`) plus PROFILE_ONCE
    ranges a warpgroup (a warpgroup that recorded more would overwrite the next one's records; the dump then
    refuses the trace)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    path = MOSAIC_CONFIG["profile"]
    if not path:
        return {}
    if interpret:
        raise ValueError("MOSAIC_CONFIG['profile'] records a compiled kernel's clock; the interpreter has none")
    ranges = blocks_per_split * profile_words_per_block(**regions) // 4 + PROFILE_ONCE
    return dict(compiler_params=plgpu.CompilerParams(profile_space=ranges, profile_dir=str(path)))


def _interpret_params(detect_races=False):
    """Pallas' GPU interpret mode (jax >= 0.10: simulated shared memory, threads, barriers and TMA on the CPU).
    Reads past an array's end return NaN (a TMA box past the end fills zeros on the GPU; NaN checks the masking)."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams(out_of_bounds_reads="uninitialized", uninitialized_memory="nan",
                              detect_races=detect_races)


def indexer_scores_mosaic(q, weights, keys, n_visible, *, block_t=None, num_stages=None, num_splits=None,
                          pad_to_block=False, precision=None, convert=None, group_max_k=None, split_m=None,
                          select_k=None, select_slack=None, epilogue=None, fp4_converter=None, interpret=False):
    """Scores [B, S, T] f32 (or [B, S, roundup(T, block_t)] with -inf padding if pad_to_block) like
    `reference.indexer_scores`, for fp8 / fp4 keys (`formats.QuantizedKeys`, fmt "fp8": values [B, T, 128], scale
    [B, T, 1]; "fp4": packed [B, T, 64] uint8, scale [B, T, 4] ue8m0; compiled only) or bf16 keys (a bfloat16
    [B, T, 128] array); q [B, S, H, 128] (fp8 / fp4 keys: fake-quantized like them), weights [B, S, H], n_visible
    [B, S] int32. precision: one of `PRECISIONS[format]`, default the first. convert: how precision "f16" turns fp8
    key codes into f16 (`CONVERTS`, default "cvt"; same scores).
    group_max_k (the k of a threshold top-k that consumes the scores): returns (scores, group_max), group_max
    [B, S, n_split, G] int32 = each CTA's maxima of the ordered keys (`topk._ordered_i32`) of the top-k's strided
    groups (G = `topk.threshold_groups(T_out, k)`), or None where that does not fit: G == 0, G not a multiple of
    block_t or above 4096, the partials not under half the row (n_split * G > T_out / 2), or T_out (the returned
    row length) != the padded length. The maxima cost one [block_t] max per block in shared memory and save the
    top-k's XLA pass over the scores.
    split_m: each block as two [block_t / 2, H] wgmmas into two accumulators, so the second half's operand load
    (and f16 conversion) and wgmma overlap the first's, and the first's epilogue the second's wgmma (compiled
    kernels only). Default (None): `DEFAULT_SPLIT_M[format]` where it applies (compiled, block_t 128 or 256).
    select_k (compiled kernels only): no scores; returns (keys, pos), each int32 [B, S, n_split * slots] (slots =
    select_k + select_slack, default slack `SELECT_CONFIG["slack"]`): every split's top-select_k superset
    (`mosaic_select`: ordered int32 keys as `topk._ordered_i32` writes them and their positions in the row,
    ascending position, padding (INT32_MIN, 0)); splits hold at most `SELECT_CONFIG["max_segment"]` keys. The
    row's top-select_k set is `topk_hist.hist_select(keys, select_k, posmap=pos)`'s (`gpu.indexer_topk_gpu`,
    topk="segment_set"). Where the row's splits run as one thread-block cluster, or the last split CTA of a row
    selects (`SELECT_CONFIG["final"]` "cluster" / "last"), the kernel selects that set itself and returns it: int32
    [B, S, select_k], ascending positions, -1 after the finite picks (`topk.as_index_set`'s layout).
    epilogue: "full", or "probe" (a timing probe, compiled only, wrong values: each key's score is the sum of its
    first 8 heads' logits, no ReLU, head weight or head sum), whose time against the default's shows what the
    per-key epilogue costs; default MOSAIC_CONFIG["epilogue"] (so the benchmarks' 'mosaic.epilogue=probe' reaches
    the kernel under every top-k).
    fp4_converter (fp4 keys at precision "fp8"; default MOSAIC_CONFIG["fp4_converter"], 0 = off): a second
    warpgroup converts each block's nibbles into e5m2 [block_t, 128] in shared memory, through this many slots
    (1-4), and the scoring warpgroup's wgmma takes them from there as it takes fp8 keys, so the conversion leaves
    the scoring warpgroup's serial chain (wait, convert, wgmma, epilogue; session 48 measured it at ~25 us of
    B = 64 x 128K on an H100). Same values as the register path (the same inline PTX, stored). The interpreter runs
    it with a jnp model of the conversion (`_fp4_e5m2_values`), so it is the fp4 path that interpret mode takes."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from .gpu import quantize_q_fp8, split_q

    fmt = key_format(keys)
    if fmt is None:
        raise ValueError("the Mosaic indexer kernel takes fp8 or fp4 keys (formats.QuantizedKeys with fmt 'fp8' / "
                         f"'fp4') or bf16 keys (a bfloat16 array); got {type(keys).__name__} "
                         f"{getattr(keys, 'fmt', getattr(keys, 'dtype', ''))}; kernel='triton' takes every format")
    key_vals = _key_values(keys)
    B, S, H, d = q.shape
    T = key_vals.shape[1]
    key_cols, n_scales = {"fp8": (d, 1), "fp4": (d // 2, d // 32), "bf16": (d, None)}[fmt]
    if d != 128 or key_vals.shape != (B, T, key_cols) or (n_scales and keys.scale.shape != (B, T, n_scales)):
        raise ValueError(f"expected q [B, S, H, 128] and {fmt} keys [B, T, {key_cols}]"
                         f"{f' (scale [B, T, {n_scales}])' if n_scales else ''}, got q {q.shape}, keys "
                         f"{key_vals.shape}{f', scale {keys.scale.shape}' if n_scales else ''}")
    if weights.shape != (B, S, H) or n_visible.shape != (B, S):
        raise ValueError(f"weights must be [B, S, H] = {(B, S, H)} and n_visible [B, S] = {(B, S)}, got "
                         f"{weights.shape} / {n_visible.shape}")
    if H > 256:
        raise ValueError(f"at most 256 heads (one wgmma N), got {H}")
    if T % 8:
        raise ValueError(f"the Mosaic indexer kernel needs the key count T to be a multiple of 8 (TMA's 8-row tile), "
                         f"got T={T}; kernel='triton' takes any T")
    precision = precision or PRECISIONS[fmt][0]
    if precision not in PRECISIONS[fmt]:
        raise ValueError(f"precision must be one of {PRECISIONS[fmt]} for {fmt} keys, got {precision!r}")
    f16 = precision == "f16"
    convert = convert or "cvt"
    if convert not in CONVERTS:
        raise ValueError(f"convert must be one of {CONVERTS}, got {convert!r}")
    if convert != "cvt" and not ((f16 and fmt == "fp8") or (fmt == "fp4" and convert == "raw")):
        raise ValueError(f"convert={convert!r} applies to precision='f16' (fp8 keys) only (fp4 keys: 'raw' only), got "
                         f"precision {precision!r}")
    epilogue = epilogue or MOSAIC_CONFIG["epilogue"]
    if epilogue not in EPILOGUES:
        raise ValueError(f"epilogue must be one of {EPILOGUES}, got {epilogue!r}")
    if epilogue != "full" and interpret:
        raise ValueError("epilogue='probe' is a compiled-kernel timing probe")
    if fp4_converter is None:   # the config's value applies where it can (benchmarks set it for every format)
        fp4_converter = (MOSAIC_CONFIG["fp4_converter"]
                         if fmt == "fp4" and precision == "fp8" and convert == "cvt" and not split_m else 0)
    fp4_converter = int(fp4_converter)
    if fp4_converter and (fmt != "fp4" or precision != "fp8" or convert != "cvt" or split_m):
        raise ValueError(f"fp4_converter applies to fp4 keys at precision 'fp8', without convert='raw' or split_m; "
                         f"got {fmt} keys, precision {precision!r}, convert {convert!r}, split_m {split_m}")
    if not 0 <= fp4_converter <= 4:
        raise ValueError(f"fp4_converter must be 0 (off) or 1-4 e5m2 slots, got {fp4_converter}")
    seg_sync, conv_sync = _config_choice("seg_sync", SEG_SYNCS), _config_choice("conv_sync", CONV_SYNCS)
    seg_hist = _config_choice("seg_hist", SEG_HISTS)
    select_wgs = _config_choice("select_wgs", SELECT_WGS)
    # "shared" reaches the converter's compiled conversion only (the interpreter runs its jnp model either way)
    fp4_tables, fp4_layout = _config_choice("fp4_tables", FP4_TABLES), _config_choice("fp4_layout", FP4_LAYOUTS)
    if fp4_layout == "auto":
        fp4_layout = "rows" if block_t_of(block_t, T) % 128 == 0 and fp4_tables == "registers" else "fragments"
    rows_layout = bool(fp4_converter) and fp4_layout == "rows"
    if rows_layout and block_t_of(block_t, T) % 128:
        raise ValueError(f"MOSAIC_CONFIG['fp4_layout'] = 'rows' gives each of the converter's 128 threads whole key "
                         f"rows: block_t must be a multiple of 128, got {block_t_of(block_t, T)}")
    if rows_layout and fp4_tables == "shared":
        raise ValueError("MOSAIC_CONFIG['fp4_layout'] = 'rows' builds each key's tables once already: fp4_tables "
                         "'shared' does not apply")
    shared_tables = bool(fp4_converter) and fp4_tables == "shared" and not interpret
    if shared_tables:   # the tables' reuse across blocks needs the converter's closing warpgroup barrier
        conv_sync = "commit"
    if shared_tables and block_t_of(block_t, T) % 128:
        raise ValueError(f"MOSAIC_CONFIG['fp4_tables'] = 'shared' builds a key's tables in one thread: block_t must be "
                         f"a multiple of the warpgroup's 128 threads, got {block_t_of(block_t, T)}")
    if split_m is None:
        split_m = DEFAULT_SPLIT_M[fmt] and not interpret and block_t_of(block_t, T) % 128 == 0
    if split_m and (interpret or block_t_of(block_t, T) % 128):
        raise ValueError("split_m needs a compiled kernel (the interpreter has no wgmma_accumulator_load) and "
                         "block_t 128 or 256 (two halves of a multiple of 64 rows, the wgmma M)")
    if interpret and (f16 or (fmt == "fp4" and not fp4_converter)):
        raise ValueError("the Mosaic indexer kernel's interpret mode runs fp8 keys at precision 'fp8', bf16 keys and "
                         "fp4 keys with fp4_converter only (the interpreter's wgmma takes no register operand, which "
                         "precision='f16' and the fp4 register path feed)")
    R = B * S
    if select_k is not None:
        if interpret:
            raise ValueError("select_k needs a compiled kernel (its selection is inline PTX)")
        if group_max_k is not None:
            raise ValueError("select_k writes no scores, so no group maxima either (group_max_k)")
        if not 1 <= int(select_k) <= T:
            raise ValueError(f"select_k must be in [1, T = {T}], got {select_k}")
        select_slack = SELECT_CONFIG["slack"] if select_slack is None else int(select_slack)
        if select_slack < 0:
            raise ValueError(f"select_slack must be >= 0, got {select_slack}")
    bt, stages, nb, bps, n_split = launch_layout(R, T, fmt, block_t=block_t, num_stages=num_stages,
                                                 num_splits=num_splits, select=select_k is not None,
                                                 converter=fp4_converter)
    slots = cluster = None
    last = False
    prune = 0
    if select_k is not None:
        slots = int(select_k) + select_slack
        if bps * bt > SELECT_CONFIG["max_segment"]:
            raise ValueError(f"select_k: a split holds {bps * bt} keys ({bps} blocks of {bt}), more than "
                             f"SELECT_CONFIG['max_segment'] = {SELECT_CONFIG['max_segment']} (its scores stay in "
                             "shared memory); give more num_splits")
        final = SELECT_CONFIG["final"]
        staged = slots % 4 == 0 and int(select_k) <= 1024   # survivors in 16-byte rows; a set the final can stage
        fits = n_split <= MAX_CLUSTER and staged and slots <= 1024
        if final not in FINALS:
            raise ValueError(f"SELECT_CONFIG['final'] must be one of {FINALS}, got {final!r}")
        # "last" where the row's survivors fit the segment buffer (a few splits a row, as at decode over long rows);
        # else (many short splits) the Triton final, whose tournament stages take any number of survivors
        last = final == "last" and staged and 2 * n_split * slots <= bps * bt
        if final == "cluster" and not fits:
            raise ValueError(f"SELECT_CONFIG['final'] = 'cluster' needs <= {MAX_CLUSTER} splits, k + slack a multiple "
                             f"of 4 and k, k + slack <= 1024; got {n_split} splits, k {select_k}, slack "
                             f"{select_slack}")
        cluster = n_split if final == "cluster" or (final == "auto" and fits) else None
        prune = int(SELECT_CONFIG["prune"]) if bps >= 2 else 0   # a split of one block has no first half
        if prune and (prune % 4 or prune < int(select_k) or not SELECT_CONFIG["stream_hist"]):
            raise ValueError(f"SELECT_CONFIG['prune'] (the candidate list's capacity) must be a multiple of 4 and >= k, "
                             f"with stream_hist on; got prune {prune}, k {select_k}, stream_hist "
                             f"{SELECT_CONFIG['stream_hist']}")
        if SELECT_CONFIG["probe"] not in (0, 1, 2) or (SELECT_CONFIG["probe"] == 2 and cluster):
            raise ValueError(f"SELECT_CONFIG['probe'] must be 0, 1 or 2 (2 without the cluster final), got "
                             f"{SELECT_CONFIG['probe']!r} (cluster final: {bool(cluster)})")
    from .topk import producer_groups

    G = 0 if group_max_k is None else producer_groups(T, nb * bt, group_max_k, block=bt, n_split=n_split,
                                                      pad_to_block=pad_to_block)
    n_phase = G // bt
    hp = -(-H // 32) * 32   # the weights' copy moves a multiple of 128 B; padded heads have weight 0
    qf = q.astype(jnp.float32)
    wf = weights.astype(jnp.float32)
    if hp != H:
        qf = jnp.pad(qf, ((0, 0), (0, 0), (0, hp - H), (0, 0)))
        wf = jnp.pad(wf, ((0, 0), (0, 0), (0, hp - H)))
    q_prep = _config_choice("q_prep", Q_PREPS)
    # "fused": the scorer prepares q itself (fp4 keys at "fp8" in the rows layout, fp8 keys with convert "cvt";
    # whole 64-head WGMMA tiles)
    q_fused = (q_prep == "fused" and hp % 64 == 0
               and ((fmt == "fp4" and not f16 and rows_layout) or (fmt == "fp8" and convert == "cvt")))
    if q_prep == "fused" and not q_fused:
        q_prep = "triton"
    if fmt == "fp8":
        if q_fused:   # raw q and weights in; the kernel makes the codes (f16, or e4m3 for "fp8") and w x s
            q_op = qf.reshape(R, hp, d)
        elif q_prep == "triton":   # one kernel: the codes (f16, or e4m3 for "fp8") and w x s
            from .q_prep import q_prep_fp8

            q_op, wf = q_prep_fp8(qf.reshape(R, hp, d), wf.reshape(R, hp), f16=f16, interpret=bool(interpret),
                                  head_block=MOSAIC_CONFIG["q_prep_heads"])
        else:
            q_op, q_scale = quantize_q_fp8(qf, "fp8")           # exact for a fake-quantized q
            wf = wf * q_scale
            if f16:   # the e4m3 codes as f16 (exact): the B operand of an f16 wgmma
                q_op = q_op.astype(jnp.float16)
            q_op = q_op.reshape(R, hp, d)
        if f16 and convert in ("alu", "mix"):   # those key operands are the values x 2^-8
            wf = wf * float(2 ** F16_BIAS_SHIFT)
    elif fmt == "fp4" and not f16:   # precision "fp8": q fake-quantized to fp4 (idempotent), then e5m2 codes of
        from .mosaic_fp4 import register_plan   # q / 2^(e - 13), in the e5m2 operand's column order

        _, columns = register_plan(64, "e5m2")
        if rows_layout:   # fp4_layout "rows": channel c in column c
            columns = np.arange(128, dtype=np.int32)
        if q_fused:   # raw q and weights in; the kernel makes the codes and w' (q_smem keeps the codes' type)
            q_op = qf.reshape(R, hp, d)
        elif q_prep == "triton":   # one kernel (no permutation MMA in the rows layout)
            from .q_prep import column_permutation, q_prep_fp4

            perm = None if rows_layout else column_permutation(columns)
            q_op, wf = q_prep_fp4(qf.reshape(R, hp, d), wf.reshape(R, hp), perm, e5m2=True, interpret=bool(interpret),
                                  head_block=MOSAIC_CONFIG["q_prep_heads"])
        else:
            q_op, wf = fp4_q_operand_e5m2(qf, wf, columns)
            q_op = q_op.reshape(R, hp, d)
    elif fmt == "fp4":   # q's channels in the order the key operand's columns hold them (`mosaic_fp4`), per
        from .mosaic_fp4 import register_plan   # (token, head) / 2^e (e: its largest magnitude's exponent) in f16

        _, columns = register_plan(64)
        if q_prep == "triton":   # one kernel: q's fp4 fake quantization too (a raw q gives the same operand)
            from .q_prep import column_permutation, q_prep_fp4

            q_op, wf = q_prep_fp4(qf.reshape(R, hp, d), wf.reshape(R, hp), column_permutation(columns),
                                  interpret=bool(interpret), head_block=MOSAIC_CONFIG["q_prep_heads"])
        else:
            q_op, wf = fp4_q_operand(qf, wf, columns)
            q_op = q_op.reshape(R, hp, d)
    else:     # bf16: hi (+ lo) as [R, terms * hp, d] (a TMA copy strides at most 5 dims: [terms, hp, d] tiled has 6)
        q_terms, n_terms = split_q(qf, "bf16", precision)
        q_op = jnp.stack(q_terms, axis=2).reshape(R, n_terms * hp, d)
    wf = wf.reshape(R, hp)
    # q_smem's type: the operand's, or with q_prep "fused" the e5m2 codes the kernel makes from the raw q [R, hp, d]
    fused_dtype = jnp.float8_e5m2 if fmt == "fp4" else jnp.float16 if f16 else jnp.float8_e4m3fn
    q_smem_shape, q_smem_dtype = ((hp, d), fused_dtype) if q_fused else (q_op.shape[1:], q_op.dtype)
    if interpret:   # the interpreter's wgmma takes no transposed operand: [.., d, hp] per term
        if fmt == "bf16":
            q_op = q_op.reshape(R, n_terms, hp, d)
        if q_fused:   # (the kernel stores its codes transposed)
            q_smem_shape = (d, hp)
        else:
            q_op = jnp.swapaxes(q_op, -1, -2)
            q_smem_shape = q_op.shape[1:]
    nv = n_visible.astype(jnp.int32).reshape(R)
    if fmt == "fp8":   # 128 B rows of e4m3
        tile = (plgpu.TilingTransform((8, 128)), plgpu.SwizzleTransform(128))
        q_tile = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)) if f16 else tile
    elif fmt == "fp4":   # 64 B rows of packed e2m1; q as f16 (128 B rows of 64), or e5m2 (128 B rows of 128)
        tile = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(64))
        q_tile = (plgpu.TilingTransform((8, 64) if f16 else (8, 128)), plgpu.SwizzleTransform(128))
    else:              # 128 B rows of 64 bf16
        tile = q_tile = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    if interpret:   # the interpreter ignores shared-memory layouts (and q is transposed there)
        tile = q_tile = ()
    args = [nv, wf, q_op, key_vals]
    scratch = [plgpu.SMEM(q_smem_shape, q_smem_dtype, transforms=q_tile),        # q_smem [(terms *) H, 128]
               plgpu.SMEM((hp,), jnp.float32),                                   # w_smem
               plgpu.SMEM((stages, bt, key_cols), key_vals.dtype, transforms=tile)]  # k_smem
    if fmt == "fp8":
        args.append(keys.scale.reshape(B * T).astype(jnp.float32))
        scratch.append(plgpu.SMEM((stages, bt), jnp.float32))                    # s_smem
    elif fmt == "fp4":   # a key's 4 ue8m0 bytes as one int32 (byte g = group g)
        args.append(jax.lax.bitcast_convert_type(keys.scale, jnp.int32).reshape(B * T))
        scratch.append(plgpu.SMEM((stages, bt), jnp.int32))                      # s_smem
    scratch += [plgpu.SMEM((2, bt), jnp.float32),                                # o_smem
                plgpu.SMEM((bt,), jnp.float32),                                  # fill_smem
                plgpu.Barrier(num_arrivals=2),                                   # q_bar: q, w
                plgpu.Barrier(num_arrivals=1 if fmt == "bf16" else 2, num_barriers=stages)]   # k_bars: keys (+ scales)
    out_type = jax.ShapeDtypeStruct((R, nb * bt), jnp.float32)
    if n_phase:
        scratch += [plgpu.SMEM((n_phase, bt), jnp.float32), plgpu.SMEM((n_phase, bt), jnp.int32)]  # gm, gi
        out_type = (out_type, jax.ShapeDtypeStruct((R, n_split, n_phase, bt), jnp.int32))
    if select_k is not None:
        from .mosaic_select import SCRATCH_WORDS

        seg_len = max(bps * bt, 2 * n_split * slots if cluster else 0)   # "last": they fit by its rule
        scratch += [plgpu.SMEM((seg_len,), jnp.int32), plgpu.SMEM((SCRATCH_WORDS,), jnp.int32)]   # seg, sel
        if prune:
            scratch.append(plgpu.SMEM((prune,), jnp.int32))                   # the candidate list
        set_type = jax.ShapeDtypeStruct((R, int(select_k)), jnp.int32)
        pairs_type = (jax.ShapeDtypeStruct((R, n_split, slots), jnp.int32),) * 2
        out_type = set_type if cluster else (set_type,) + pairs_type if last else pairs_type
    # seg_hist "converter": where the converter warpgroup runs the segment top-k's streamed histogram (compiled; the
    # selection's PTX does not interpret), unless pruning, whose threshold the scorer takes
    hist_conv = (seg_hist == "converter" and bool(fp4_converter) and select_k is not None and not interpret
                 and bool(SELECT_CONFIG["stream_hist"]) and not prune)
    # select_wgs 2: the converter warpgroup joins the plain selection (one split's survivors, Triton final)
    sel_threads = 256 if (select_wgs == 2 and hist_conv and not cluster and not last
                          and not SELECT_CONFIG["probe"]) else 128
    if fp4_converter:   # the converter's e5m2 slots (fp8 keys' smem layout), key factors, full / empty barriers
        conv_tile = () if interpret else (plgpu.TilingTransform((8, 128)), plgpu.SwizzleTransform(128))
        scratch += [plgpu.SMEM((fp4_converter, bt, 128), jnp.float8_e5m2, transforms=conv_tile),
                    plgpu.SMEM((fp4_converter, bt), jnp.float32),
                    plgpu.Barrier(num_arrivals=1, num_barriers=fp4_converter),
                    plgpu.Barrier(num_arrivals=1, num_barriers=fp4_converter)]
        if shared_tables:   # the keys' e5m2 table words, built once a key
            scratch.append(plgpu.SMEM((8, bt), jnp.int32))
        if hist_conv:   # seg_ready (a block's scores stored, by the scorer's 128 threads), hist_done (converter's)
            scratch += [plgpu.Barrier(num_arrivals=1, num_barriers=HIST_LAG + 1), plgpu.Barrier(num_arrivals=1)]
    kernel = plgpu.kernel(
        functools.partial(_kernel, T=T, bt=bt, stages=stages, bps=bps, nb=nb, S=S, precision=precision,
                          convert=convert, n_phase=n_phase, split_m=bool(split_m), fp4=fmt == "fp4",
                          epilogue=epilogue, converter=fp4_converter, shared_tables=shared_tables, hist_conv=hist_conv,
                          rows_layout=rows_layout, seg_sync=seg_sync, conv_sync=conv_sync, q_fused=q_fused,
                          select=None if select_k is None else dict(
                              k=int(select_k), slots=slots, aggregate=bool(SELECT_CONFIG["aggregate"]),
                              stream_hist=bool(SELECT_CONFIG["stream_hist"]), cluster=cluster, last=last, prune=prune,
                              probe=int(SELECT_CONFIG["probe"]), threads=sel_threads),
                          interpret=interpret),
        out_type=out_type,
        **(dict(grid=(R,), grid_names=("r",), cluster=(n_split,), cluster_names=("s",)) if cluster else
           dict(grid=(R, n_split), grid_names=("r", "s"))),
        **(dict(num_threads=2, thread_name="wg") if fp4_converter else {}),
        **profile_params(bps, interpret, refill_region=bool(fp4_converter) and conv_sync == "early",
                         hist_regions=hist_conv),
        scratch_types=scratch,
        kernel_name=(f"indexer_scores_{fmt}_mosaic_{precision}_t{bt}" + (f"_{convert}" if convert != "cvt" else "")
                     + (f"_g{G}" if n_phase else "") + ("_m2" if split_m else "")
                     + ("_epiprobe" if epilogue != "full" else "")
                     + (f"_sel{select_k}" if select_k is not None else "") + ("_cl" if cluster else "")
                     + ("_last" if select_k is not None and last else "")
                     + (f"_pr{prune}" if select_k is not None and prune else "")
                     + (f"_cv{fp4_converter}" if fp4_converter else "") + ("_tsh" if shared_tables else "")
                     + ("_rows" if rows_layout else "")
                     + ("_segc" if select_k is not None and fp4_converter and seg_sync == "commit" else "")
                     + ("_cva" if fp4_converter and conv_sync == "arrive" else "")
                     + ("_cve" if fp4_converter and conv_sync == "early" else "") + ("_hcv" if hist_conv else "")
                     + ("_s2" if sel_threads == 256 else "") + ("_qf" if q_fused else "")),
        **(dict(interpret=_interpret_params(interpret == "races")) if interpret else {}),
    )
    res = kernel(*args)
    if cluster:
        return res.reshape(B, S, int(select_k))
    if select_k is not None and last:   # the survivors were the kernel's own scratch
        return res[0].reshape(B, S, int(select_k))
    if select_k is not None:
        return tuple(x.reshape(B, S, n_split * slots) for x in res)
    out, gmax = res if n_phase else (res, None)
    out = out.reshape(B, S, nb * bt)
    out = out if pad_to_block else out[..., :T]
    if group_max_k is None:
        return out
    return out, (gmax.reshape(B, S, n_split, G) if n_phase else None)
