"""Warp-specialised GPU kernel for sparse shared-KV MQA with a sink, written against Mosaic GPU (bf16 or FP8 pools).

Why not Pallas: a producer has to gather each block's KV rows into the (8, 64)-tiled, 128 B-swizzled layout the
tensor cores read, and Hopper has no TMA gather, so one 1 KB row is 8 bulk copies of 128 B. Pallas'
`copy_gmem_to_smem` makes the warpgroup's 128 threads arrive on the barrier for every copy: 0.77 TB/s for the producer
alone. With one `arrive_expect_tx` per block and copies that do not arrive, the same gather runs at 3.4-3.9 TB/s
(benchmarks/tma_row_gather_{probe,raw}.py, NOTES_sparse_attention.md session 8). Pallas does not expose the second
form, so this kernel uses `jax.experimental.mosaic.gpu` (the layer under Pallas) directly.

CTA = (query row i, head group h, split s), 64 heads (one wgmma M), three warpgroups. More heads (V4-Pro's 128) are
G = H / 64 head groups, one CTA each, like FlashMLA's 64-head blocks: CTA x = i * G + h, so the groups of a row run
side by side and the second group's gathers of the same KV rows mostly hit L2.
* warpgroup 2, the **producer**: copies q [64, d] and the sinks (one bulk copy each), this split's index rows, then
  for every step gathers `block_k` rows into ring slot g % stages: one thread registers the slot's byte count, lane 0
  of each of the 4 warps issues the 8 piece copies of every 4th row. The index lists and lengths arrive as the
  caller gave them (no XLA pass before the kernel): once the rows land, the producer's 128 threads rewrite entries
  outside [0, rows) or at positions >= the row's length (clamped to [0, K]) as -1 and release the consumers through
  named barrier 9. Invalid entries copy row 0, which the consumers mask out. Per-SM gather rate (session 14's
  phase profile): a 64 KB block takes ~4600-4770 cycles to issue at any occupancy, ~1/132 of HBM, with bulk copies
  and with `producer="cp_async"` alike; decode is slow where SMs are not issuing (setup, the last step, the
  epilogue, waits for one of the two slots), see NOTES_sparse_attention.md session 14.
  Index rows held whole cost 4 B an entry of shared memory, so a long list (HCA decode: 128 + 8192 entries a row)
  used to force the default into many short splits (HCA-8K B=64: 15 x 9 blocks, 960 CTAs and an XLA merge). Where a
  split's whole lists do not fit, they are **streamed** instead (`idx_stream`, session 29): each producer thread
  loads its entry of the next step from global memory while the current step waits and issues, cleans it into a
  ring of a few steps' entries in shared memory, and the consumers read the ring slot after the step's full
  barrier. H200, net of dispatch: HCA-8K B=64 253.5 -> 187.6-206.5 us (1.74x -> 1.29-1.42x the floor), B=128
  493 -> 373-390 us, HCA-1K B=128 77.2 -> 62.6-63.0 us; HCA prefill (2048 queries x 8320 entries) 347 -> 401
  TFLOP/s. Lists that fit stay whole (streaming them costs CSA decode 3-5%).
* warpgroups 0 and 1, the **consumers**, as the symmetric **pair** (wherever an option names one of the pair's modes;
  bf16 pools default to "asym" below since session 66, FP8 pools since session 68): both hold the scores S = q K^T
  [64, block_k] (wgmma, both operands in shared memory). By default (`split_d`, session 18) each computes S over its own
  half of d and the two swap their f32 partials through a 32 KB shared buffer, so the score work is done once (CSA
  decode 14-16% faster, prefill S=16K 380 vs 302 TFLOP/s); with split_d=False both compute all of S, with split_scores
  each computes half the columns and they swap P. Then the online softmax in exp2 units with the running max initialised
  at the sink logit (so it is always finite), and P.V for their own half of the d output columns: each holds a [64, d/2]
  f32 accumulator. After P.V both arrive on the slot's "consumed" barrier, which the producer waits on before refilling
  it.
* the pair's decode (session 56, `piece_barriers="rows"`): the ring's full barriers are per (slot, 128 B piece of
  d), and each consumer waits for each of its own pieces just before that piece's score wgmma instead of for the
  whole block (H100: decode 0.4-3.5% faster; prefill 2.5% slower, so off there). The piece-major issue order of FlashMLA's
  fine-grained pipelining (`"pieces"`) is 1-9% slower on the H100, where decode is memory-bound.
* `consumers="asym"` (session 64, bf16 rings and FP8's tile rings; **the bf16 default since session 66, FP8's since
  session 68**, see DEFAULT_CONSUMERS: on an H100 bf16 decode 0-6.5% and prefill 9-10% faster than the pair, FP8 over
  the converter's tiles decode at B >= 64 3-14% and prefill 9-10% faster): FlashMLA's decode split instead of the
  pair. Consumer 0 scores over all of d, runs the softmax and hands P (bf16) and its rescale factors to
  consumer 1 through shared memory (8 KB + 256 B a ring slot, one named barrier); each runs P.V over its half of the
  output columns, consumer 1's of step g under consumer 0's scores of step g + 1. See `_build`'s asym.
* the q tile becomes the output tile once both consumers are past their last scores (a barrier between them).
* `split_scores` (bf16 pools; the prefill default from session 12 to 17, now only where split_d is off and T >=
  SPLIT_SCORES_MIN_T queries per sequence): each consumer
  computes the scores of its half of the block's entries only and the two exchange bf16 P halves and integer row
  maxima through shared memory (one named barrier per block, buffers alternating with the step's parity); l is
  summed per consumer and combined at the end. Without it both consumers compute all the scores: 12.6 instead of 8.4
  MFLOP per 64-entry block. H200 (session 12): prefill S=16K 4.57 vs 4.79 ms (301 vs 287 TFLOP/s), 128 heads S=4K
  2.09 vs 2.45 ms; decode within the spread at 64 heads (HCA-1K B=64 51-55 vs 59-61 us) but slower at 128 heads
  (CSA B=128 88 vs 65 us), hence prefill only. Its error against the reference is 1.2-1.4x the default's (per call
  in the tiny model 2.3-2.8e-3 vs 1.8-2.1e-3): the integer running max leaves a block's largest P off 1.0, so
  more P values round in bf16. The session-12 model-level miss (logit error 0.113) was not the kernel: the tiny
  model's MoE router flips an expert for one prefill token under any attention perturbation of this size (random
  noise of relative norm 1.9e-3 flips it in 2 of 6 seeds on the CPU), so the GPU model test now routes by hash.

FP8 pools (spec §4.2 rows, `Fp8KVPool`; both sources FP8, block_k 64): the producer stages each block's raw rows
(nope: 2 bulk copies of 256 + 192 B into 512 B-strided rows, rope: 1 bulk copy, the 8 scale bytes: one `cp.async`
tracked by the slot barrier through `cp.async.mbarrier.arrive.noinc`, so that barrier counts 1 + 4 arrivals). The
consumers dequantize the staged block into one bf16 tile in the swizzled layout, release the staging slot, then run
the same wgmma steps on the tile. With split_d (the FP8 default since session 19, with one staging slot: the 32 KB
exchange does not fit next to two) each consumer reads only its own half of d's columns, so each converts only that
half (consumer 0 the nope blocks 0-3, consumer 1 the blocks 4-6 and the rope part) between two barriers of its own
warpgroup; without split_d the 256 consumer threads convert the whole tile between two 256-thread barriers. H200,
CSA decode B=64 kernel time: 58.0 us on the Triton kernel (the FP8 default until session 18), 56.2 on this one
without split_d, 38.4 with split_d and both consumers converting the whole tile, 34.1 with each its own half; FP8
prefill S=16K 238 vs 138 TFLOP/s on Triton. So kernel="auto" takes FP8 pools here (`mosaic_applies`). The
dequantization's conversion instructions are not what binds: one conversion per e4m3 pair instead of four
(fp8_convert="rebias") measured the same (34.6 vs 34.1 us). What binds is that the conversion runs serially
before the consumers' scores; `fp8_dequant="producer"` moves it to the producer warpgroup, which converts into a
ring of two 32-row bf16 tiles ahead of the consumers: correct, but then the producer (conversion + issuing the
copies, ~4800 cycles per 32-row step) binds instead, so it is no faster (session 22) and off. The default since
session 25 is `fp8_dequant="converter"` (a fourth warpgroup converts the staging ring into 32-row tiles; with the
four conversion instructions a pair of "cvt" since session 67, 3-7% faster than "rebias" there). Since session 71
it runs with f16 tensor-core operands (one conversion instruction a pair, q converted in the kernel), its "owned"
chunk order, the producer's rows as two 1-D bulk copies, and under asym a quarter of P.V on the helper and q's
first 256 columns in the scorer's registers (H100: 11-15% faster FP8 decode at B >= 64 than the session-68 shape;
see DEFAULT_FP8_OPERANDS' note).
`fp8_dequant="direct"` (session 55, FlashMLA's producer shape) drops the staging ring: the producer gathers raw
rows straight into (registers or) the upper pieces of the 64-row tile they become, converts them there, and the
consumers run bf16's 64-row steps; correct, but 13-23% slower than the converter on the H100, as its fill of a
step cannot overlap the previous step's conversion (no room for a third buffer), so it is off.

Step sequence (the same in all three roles): the window list's valid blocks of this split, then the compressed
list's; a source's blocks past its valid length are not visited. Outputs as gpu.py: one split -> o with the sink in
the denominator, lse without it; split-K -> partials normalised by their own sum, merged either inside the kernel
(`combine="cluster"`: the row's splits are one thread-block cluster and merge through distributed shared memory,
the default where the clusters fit on the GPU at once; H200 session 16: 4-5 us per decode call less at B = 16-64)
or after it (`common.combine_splits` / `combine.combine_splits_pallas`). Where the default split count's clusters do
not fit, the default takes fewer splits whose clusters do if that costs a CTA at most 64 more entries
(`_fewer_splits_that_fit`, session 56: CSA B=32 20.7 -> 19.9 us of kernels on the H100, HCA-1K B=32 28.3 -> 25.6).
Past one wave of CTAs (decode rows x head groups > 132, one CTA an SM), one split a row left the last wave's few
CTAs as long as a full one: the default now takes the split count of least estimated time (`wave_splits`, session
57; H100, HCA-8K B=136 733 -> 524 us, B=160 731 -> 546, FP8 929 -> 602; short lists keep one split).

Not interpretable on CPU, but it lowers there (CI: tests/test_gpu_lowering.py); runs on Hopper (sm_90a) only.
"""

from __future__ import annotations

import contextlib
import math

import jax
import jax.numpy as jnp
import numpy as np

from . import combine as combine_lib
from . import common
from .fp8_layout import NOPE_DIM, ROPE_DIM, SCALE_BYTES, Fp8KVPool

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
BLOCK_H = 64          # heads per CTA = the M of one warpgroup's wgmma
SPLIT_SCORES_MIN_T = 64   # split_scores=None: on with bf16 pools from this many queries per sequence (prefill)
SMEM_BUDGET = 227 * 1024
NOPE_STRIDE = 512     # staged FP8 nope row: 448 B padded so every row's bulk copies land 128 B aligned
PDQ_TILES = 2         # fp8_dequant="producer": bf16 tiles of 32 rows the producer converts into, ahead of the consumers
PDQ_STAGING = 3       # ... and its default staging slots (32 raw rows each)
LAZY_RESCALE_LOG2 = 8.0   # lazy_rescale: the running max moves only when a block's max passes it by this (log2 units)
CONV_UNITS = 9        # a 32-row step's conversion in passes of 128 16-byte chunks: 7 nope (32 x 28), 2 rope (32 x 8)


# Dequantizing one e4m3 pair with the hardware conversions (the default): $1 = 2 e4m3 bytes, $2 = 2^k as f32,
# $0 = the bf16 pair (low half = lower byte). e4m3 -> f16 -> f32 is exact, x 2^k exact, and the product has 4
# significant bits, so the bf16 rounding is exact too.
CVT_ASM = """{ .reg .b32 h; .reg .b16 a, b; .reg .f32 fa, fb;
cvt.rn.f16x2.e4m3x2 h, $1;
mov.b32 {a, b}, h;
cvt.f32.f16 fa, a;
cvt.f32.f16 fb, b;
mul.f32 fa, fa, $2;
mul.f32 fb, fb, $2;
cvt.rn.bf16x2.f32 $0, fb, fa; }"""
# The alternative without conversion instructions (`_diag="bits"`; correct on the H200 but measured 17% slower,
# session 9): byte b = s eeee mmm placed as bf16 bits s 0000eeee mmm0000 is the e4m3 value x 2^-120 exactly,
# subnormals included (both formats' subnormals are 0.m x 2^(1 - bias)); exact bf16 multiplies by 2^120 and by the
# block scale 2^k give value x 2^k. $2 = 4 e4m3 bytes, $3 = 2^k as a bf16 pair; $0 = bf16 of bytes 0, 1, $1 = 2, 3.
# (e4m3 NaN bytes come out finite; the quantizer never writes them.)
BITS_ASM = """{ .reg .b32 z, c, x0, x1, t0, t1, u0, u1;
mov.b32 z, 0;
mov.b32 c, 0x7B807B80;
prmt.b32 x0, $2, z, 0x4140;
prmt.b32 x1, $2, z, 0x4342;
shl.b32 t0, x0, 8;
and.b32 t0, t0, 0x80008000;
shl.b32 u0, x0, 4;
and.b32 u0, u0, 0x07F007F0;
or.b32 t0, t0, u0;
shl.b32 t1, x1, 8;
and.b32 t1, t1, 0x80008000;
shl.b32 u1, x1, 4;
and.b32 u1, u1, 0x07F007F0;
or.b32 t1, t1, u1;
mul.rn.bf16x2 t0, t0, c;
mul.rn.bf16x2 t1, t1, c;
mul.rn.bf16x2 $0, t0, $3;
mul.rn.bf16x2 $1, t1, $3; }"""
# fp8_convert="rebias": one conversion instruction per pair instead of four. e4m3x2 -> f16x2 is exact and every
# e4m3 value is an f16 normal whose 10-bit mantissa uses only its top 3 bits, so shifting the f16's exponent and
# mantissa right by 3 (the sign stays) gives bf16 bits with the same exponent field and the same 3 mantissa bits:
# the value x 2^(15 - 127) = x 2^-112 exactly, zero included. Two exact bf16x2 multiplies by 2^a and 2^b (a + b =
# 112 + k, each in [-8, 120] for any scale byte, so both are bf16 normals) give value x 2^k, rounded once where it
# falls out of bf16's normal range, as the reference's cast does. $1 = 2 e4m3 bytes, $2 / $3 = 2^a / 2^b as bf16
# pairs; $0 = the bf16 pair (low half = lower byte). Built on the guess that the default's four conversions per
# pair (16 per SM per cycle on the H200) bind the dequantization; measured the same speed (session 19), so "cvt"
# stays the default and this stays an option.
REBIAS_ASM = """{ .reg .b32 h, t, m;
cvt.rn.f16x2.e4m3x2 h, $1;
and.b32 t, h, 0x7FFF7FFF;
shr.u32 t, t, 3;
mov.b32 m, 0x80008000;
lop3.b32 t, t, h, m, 0xF8;
mul.rn.bf16x2 t, t, $2;
mul.rn.bf16x2 $0, t, $3; }"""

# fp8_operands="f16" (session 69): the tiles, q and P as f16 tensor-core operands instead of bf16. e4m3x2 -> f16x2
# is exact, and two f16x2 multiplies give value x 2^k: $2 = 2^e1 (e1 = k clamped to [-14, 15], an f16 normal, so the
# first product is exact: every e4m3 value x 2^-14 sits on f16's subnormal grid), $3 = 2^(k - e1) (1 in range;
# below it a subnormal or 0, above it a power up to 2^15 or inf), so the result is value x 2^k rounded once to f16:
# exact for |value| in [2^-14, 65504], on f16's subnormal grid (absolute error <= 2^-25) below, inf above (a row
# block whose values pass f16's range gives inf / NaN scores: loud, never silently wrong). One conversion
# instruction a pair instead of the default's four (cvt / HADD2.F32 x 2 / pack), and two multiplies instead of two
# f32 multiplies. $1 = 2 e4m3 bytes; $0 = the f16 pair (low half = lower byte).
F16_CVT_ASM = """{ .reg .b32 h;
cvt.rn.f16x2.e4m3x2 h, $1;
mul.rn.f16x2 h, h, $2;
mul.rn.f16x2 $0, h, $3; }"""
# bf16 pair -> f16 pair (q and the FP8 rows' bf16 rope part under fp8_operands="f16"): bf16 -> f32 is exact (a
# shift), f32 -> f16 rounds to nearest, inf past 65504, subnormal below 2^-14. $1 = the bf16 pair, $0 = the f16 pair.
BF16_TO_F16_ASM = """{ .reg .b32 t; .reg .f32 a, b;
shl.b32 t, $1, 16;
mov.b32 a, t;
and.b32 t, $1, 0xFFFF0000;
mov.b32 b, t;
cvt.rn.f16x2.f32 $0, b, a; }"""


def default_config(rows: int, total_blocks: int, decode: bool = True, block_k: int = 64):
    """rows = query rows x head groups (a CTA each per split), total_blocks of block_k entries a row (FP8's tile
    ring: 32); the split count is `common.split_count`'s."""
    return dict(block_k=64, num_stages=2, n_splits=common.split_count(rows, total_blocks, decode, block_k))


def _check_swizzle_alignment(smem):
    """Mosaic GPU packs the scratch buffers back to back in tree order, with no padding (barriers 8 B each). Every
    tiled bf16 / f16 buffer ([..., 8, cols]: the ones wgmma or TMA read or write swizzled) must start 1 KB aligned, as
    the hardware takes the swizzle pattern from the address bits while `store_tiled` computes it from the offset in
    the buffer: misaligned, the two disagree, which is silently wrong, not an error. (split_d's f32 partials are
    written and read by `store_tiled` / `load_tiled` alone, which agree with each other anywhere.) Raises
    AssertionError naming the first misaligned buffer."""
    import jax.experimental.mosaic.gpu as mgpu
    offset = 0
    for leaf in jax.tree.leaves(smem, is_leaf=lambda x: isinstance(x, (mgpu.Barrier, mgpu.TMABarrier))):
        if isinstance(leaf, (mgpu.Barrier, mgpu.TMABarrier)):
            offset += 8 * leaf.num_barriers
            continue
        if len(leaf.shape) >= 4 and leaf.shape[-2] == 8 and leaf.dtype in (jnp.bfloat16, jnp.float16):
            assert offset % 1024 == 0, f"swizzled scratch buffer {leaf} at byte {offset}, not 1 KB aligned"
        offset += math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize


def _build(bt, ns, d, bk, stages, bps, srcs, idx_rows, scale2, out_split, fp8=False, diag=None,
           regs=None, n_hg=1, split_scores=False, profile=None, cp_async=False, l2_ahead=0, ccomb=False,
           store_wait_read=False, idx_first=False, pingpong=False, cluster_early=False, split_d=False,
           fp8_convert="cvt", fp8_overlap=False, pdq=False, conv=False, conv_units=None, chunk_order="rows",
           n_tiles=PDQ_TILES, conv_batch=1, lazy=False, idx_ring=0, direct=False, direct_tile=False,
           direct_prefetch=False, piece_bars=False, ahead=False, asym=False, f16=False, fp8_copy="tma",
           scorer_cols=None, q_reg_cols=0):
    """The Mosaic GPU kernel as a callable:
    (q [BT, G, 64, d] bf16, sinks [G, 64] f32, then per source idx [BT, K] int32 (-1 = no entry), len [BT] int32,
    pool [rows, d] bf16 -- or with fp8, the pool's three parts nope [rows, 448] e4m3, rope [rows, 64] bf16,
    scale [rows, 8] uint8) -> (o [BT, (ns,) G, 64, d] bf16, lse [BT, (ns,) G, 64] f32); the ns axis only with
    split-K. G = n_hg head groups of 64: CTA x = row * G + group, so a row's groups run side by side and the second
    group's gathers of the same KV rows mostly hit L2.
    Shared memory, bf16: q/o tile 64 KB (d = 512), `stages` x block_k x d x 2 B ring (block_k = 32: both in (8, 32)
    tiles with 64 B swizzle instead of (8, 64) and 128 B), this split's index rows,
    sinks|lse. fp8: q/o tile, one bf16 KV tile (block_k x d, the consumers' dequantized block), and a staging ring of
    `stages` x block_k raw rows (nope padded to 512 B, as a bulk copy's shared address must be 128 B aligned; rope
    128 B; scales 8 B). pdq (FP8, split_d, block_k 32: `fp8_dequant="producer"`): the producer warpgroup converts
    the staging ring into a ring of PDQ_TILES bf16 tiles ((8, 32) tiles, 64 B swizzle, like q), which the consumers
    read as they read a bf16 ring. conv (`fp8_dequant="converter"`): the same rings, but a fourth warpgroup (wg 3, 512
    threads per CTA) converts, so the producer only issues copies (staging slots released by the converter's 128
    arrivals) and regs is (producer, converter, consumer).
    direct (FP8, split_d: `fp8_dequant="direct"`): no staging ring. The producer's 128 threads load each step's raw
    rows from global memory into registers (16 B loads at the rows' own addresses, conv_batch chunks at a time),
    convert them and store the bf16 rows into the tile ring (n_tiles tiles of bk rows; bk = 64 gives 128 B swizzle
    tiles, which the consumers read exactly as a bf16 ring), as FlashMLA's FP8 decode producer does: no bulk copies
    to issue and no staging round trip through shared memory, so two 64-row tiles fit next to q and the exchange.
    direct_tile (direct, bk = 64): the raw rows are staged in the tile they will be converted into instead of in
    registers: 16 B cp.async copies (no registers held while they fly) put a step's raw nope rows and scales into
    the tile's pieces DIRECT_RAW_PIECE.. (unswizzled 128 B row slots) and its rope rows straight into their final
    place (piece 7, swizzled); the producer converts the chunks bound for the pieces below the raw area from it,
    holds the rest in registers, and after a warpgroup barrier stores those over the raw area.
    direct_prefetch (direct): before its step's loads, the producer asks L2 for the next step's raw rows
    (`prefetch.global.L2` of each row's 128 B lines: nope, rope and scale bytes; no shared memory, nothing to wait
    for), so the next fill's loads hit L2 while this step converts with nothing else in flight.
    idx_ring (0 or the ring's depth in steps): 0 = the split's whole index lists land in shared memory at the start
    (one bulk copy, cleaned in place by the producer). n > 0 = streamed: shared memory holds the entries of n steps,
    a ring slot per step; the producer loads each step's entries from global memory a step ahead (one per thread,
    into a register), cleans them into slot g % n when it issues step g, and the consumers read that slot after
    the step's full barrier. Shared memory then no longer grows with the list, so a long split (HCA's 8K entries)
    keeps split_d, the FP8 tile ring and one CTA per SM instead of splitting into many short CTAs. n must exceed
    the producer's lead over the consumers (stages, + the tile ring's depth with FP8 tiles).
    piece_bars (False, "rows" or "pieces"; bf16 ring, TMA producer, split_d): one full barrier per (slot, 128
    B-swizzle piece of d) instead of one per slot. The producer registers each piece's bytes on its own barrier,
    and each consumer waits for each of its own pieces just before that piece's 4 score wgmma. "rows" issues a
    block row by row (each row's pieces together, as without piece_bars); "pieces" issues all rows' piece p, then
    the next (0, P/2, 1, P/2 + 1, ...: the two consumers' halves alternate), each lane-0 thread holding its 16
    rows' indices in registers, so a score chain runs while the rest of its block lands (FlashMLA's fine-grained
    copy / GEMM pipelining) instead of after all of it.
    ahead (split_d; bf16 ring or FP8 tile ring: `score_ahead`): the consumers carry each step's complete scores
    into it and issue the next step's score wgmma before the softmax (consume_ahead), holding two ring slots.
    asym (64-row steps of a bf16 ring or of the direct FP8 gather's tile ring, or the converter's 32-row tiles
    (64 B swizzle: P is [64, 32] a slot, S one m64n32 chain over all of d); without split_d / split_scores /
    pingpong / piece_bars / ahead: `consumers="asym"`, FlashMLA's decode split of the two consumers; with `direct`,
    FlashMLA's whole FP8 decode shape): consumer 0, the scorer, computes S over all of d
    (32 m64n64k16 wgmma, q from shared memory), runs the softmax, writes P (bf16, the wgmma's tiled 128 B-swizzled
    layout) and the rescale factors alpha into ring slot g % n_ring of two small buffers, arrives on named barrier
    12 + slot, then runs P.V over its half of the output columns with P from registers. Consumer 1, the helper,
    waits on that barrier, rescales its accumulator by alpha and runs P.V over the other half with P from shared
    memory. Nothing else passes between them: no partial scores (split_d's 32 KB and two barriers a step), the
    softmax is computed once, and the helper's P.V of step g runs while the scorer scores step g + 1. The P and
    alpha slots need no barrier of their own: the scorer writes slot g % n_ring only after the ring's full barrier
    of step g, which needs both consumers' empty arrivals of step g - n_ring, which the helper gives after its P.V
    read P. For the same reason the scorer cannot arrive twice on one named barrier before the helper waited on it.
    At the end the scorer's 1 / l goes to the helper through shared memory (x_a's last row).
    f16 (conv and asym: `fp8_operands="f16"`): the tensor cores' operands are f16, not bf16. The q input and the o
    output are declared f16 (the wrapper bitcasts: the bits stay bf16's), the q tile, the tile ring and P are f16.
    Once q has landed, the two consumers convert its tile in place (bf16 -> f16, 16 chunks of 16 B a thread) and
    meet at named barrier 8 before the first scores; the converting warpgroup(s) write the tiles with F16_CVT_ASM
    (and the rope part through BF16_TO_F16_ASM); the softmax rounds P to f16; the output tile holds bf16 bits.
    fp8_copy (FP8 staging rings: `fp8_copy`): how the producer issues a raw row's 448 nope and 128 rope bytes into
    its staging slot. "tma": three 2-D tensor copies (a box moves at most 256 elements: 256 + 192 nope, 64 rope),
    lane 0 of each warp taking its rows one after another. "bulk": two 1-D bulk copies (`cp.async.bulk`, no tensor
    map, any multiple of 16 B: 448 and 128), still lane 0's. (A third mode issued a warp's rows from 8 lanes at once,
    each lane's scale cp.async arriving on the staging barrier; it faulted on an H100 in session 70 and is gone.)
    scorer_cols (conv and asym: `asym_scorer_cols`; None = d / 2): the output columns whose P.V the scorer runs, the
    helper running the rest, in m64n128 pieces. 128 moves a quarter of P.V off the scorer, which under FP8's asym
    sets the consumers' pace (the helper waits for its P most of each step), onto the helper (three accumulators,
    192 registers); regs is then (producer, converter, scorer, helper), each consumer raising its own setmaxnreg.
    q_reg_cols (conv and asym: `asym_q_regs`; 0 = none): the scorer holds q's first q_reg_cols columns in registers
    (loaded once, in its branch) and takes them as the score wgmma's A operand from registers, the rest from shared
    memory. A 32-row step's score chain with both operands in shared memory re-reads all of q (64 KB) and is bound
    by shared memory (benchmarks/smem_traffic_model.py); each 32 columns in registers take 4 KB of it off every step
    for 8 registers a thread.
    profile ((entries per warpgroup, dump directory) or None): Mosaic GPU's on-device profiler records each
    warpgroup's named regions (thread 0 of the warpgroup: SM clock at entry and exit) and the wrapper dumps a Chrome
    trace per call into the directory (benchmarks/mosaic_phase_profile.py reads it). Without it the regions emit
    nothing."""
    import jax.experimental.mosaic.gpu as mgpu
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils as mu
    from jax._src.interpreters import mlir as jax_mlir
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, gpu, llvm, memref, nvvm, scf, vector

    n_src = len(srcs)
    n_in = 5 if fp8 else 3      # gmem refs per source
    tiles = pdq or conv or direct   # FP8 rows converted into a ring of bf16 tiles outside the consumers
    assert not (pdq or conv) or bk * (NOPE_DIM // 16 + ROPE_DIM // 8) == 128 * CONV_UNITS, bk
    assert not direct or ((split_d or asym) and bk in (32, 64)), (split_d, bk)
    assert not direct_tile or (direct and bk == 64), (direct, bk)   # 128 B swizzle: (8, 64) tiles
    assert not piece_bars or (split_d and not fp8 and not cp_async), (split_d, fp8, cp_async)
    assert not ahead or (split_d and not split_scores and not pingpong and not fp8_overlap and not piece_bars
                         and (tiles or not fp8)), "score_ahead"
    n_ring = n_tiles if tiles else stages   # the slots the consumers read: tile ring or KV ring
    assert not asym or ((not fp8 or direct or conv) and (bk == 64 or (conv and bk == 32)) and n_ring <= 4
                        and not (split_d or split_scores or pingpong or piece_bars or ahead)), "asym"
    assert not f16 or (conv and asym), "f16 operands: the converter's tiles under asym"
    assert fp8_copy == "tma" or (fp8 and not direct and fp8_copy == "bulk"), fp8_copy
    scorer_cols = d // 2 if scorer_cols is None else scorer_cols
    uneven = scorer_cols != d // 2   # the consumers' P.V columns split unevenly (conv + asym, 128-column pieces)
    assert not q_reg_cols or (conv and asym and q_reg_cols % 64 == 0 and 0 < q_reg_cols <= d), q_reg_cols
    assert not uneven or (conv and asym and scorer_cols % 128 == 0 and 0 < scorer_cols < d // 2
                          and len(regs) == 4), (scorer_cols, conv, asym, regs)
    conv_units = CONV_UNITS if conv_units is None else conv_units
    # the producer's share of each step's conversion: all of it (pdq), the units past conv_units (conv), or none
    p_units = (0, CONV_UNITS) if pdq else (conv_units, CONV_UNITS) if conv and conv_units < CONV_UNITS else None
    dh = d // 2
    # bf16 rings: 128 B swizzle with (8, 64) tiles; block_k = 32 takes 64 B swizzle with (8, 32) tiles, as P.V
    # contracts over block_k in groups of the swizzle's width (wgmma: K % (swizzle / 2 B) == 0). FP8: 128 B.
    swz = 128 if bk % 64 == 0 else 64
    tc = swz // 2          # bf16 columns per tile row (one swizzle span)
    pieces = d // tc
    idx_base = [sum(idx_rows[:k]) for k in range(len(idx_rows))]   # source k's rows in the flat idx_smem
    idx_len = idx_ring * bk if idx_ring else sum(idx_rows)           # idx_smem's entries
    assert not idx_ring or (bk <= 128 and not cp_async and not l2_ahead
                            and idx_ring > stages + (n_tiles if tiles else 0)), (idx_ring, bk, cp_async, l2_ahead)

    def body(ctx, *refs):
        q_gmem, sink_gmem = refs[0], refs[1]
        src_gmem = [refs[2 + n_in * k: 2 + n_in * (k + 1)] for k in range(n_src)]
        o_gmem, lse_gmem = refs[2 + n_in * n_src], refs[3 + n_in * n_src]
        scratch = refs[-1]
        if conv and asym:   # as conv, with asym's P slots right after the tile ring and alpha slots in place of x_s
            (q_smem, ring, x_p, nope_st, rope_st, scale_st, idx_smem, vec_smem, x_a), (q_bar, idx_bar), \
                (st_bars, st_empty, full_bars, empty_bars, cons_bar) = scratch
        elif conv:   # as pdq, plus st_empty: the converter's release of a staging slot to the producer
            (q_smem, ring, nope_st, rope_st, scale_st, x_s, idx_smem), (q_bar, idx_bar), \
                (st_bars, st_empty, full_bars, empty_bars, cons_bar) = scratch
        elif pdq:   # full / empty: the bf16 tile ring's (producer -> consumers); st_bars: the staging slots' copies
            (q_smem, ring, nope_st, rope_st, scale_st, x_s, idx_smem), (q_bar, idx_bar), \
                (st_bars, full_bars, empty_bars, cons_bar) = scratch
        elif direct and asym:   # the tile ring, then asym's P and alpha slots (as for a bf16 ring)
            (q_smem, ring, x_p, idx_smem, vec_smem, x_a), (q_bar, idx_bar), (full_bars, empty_bars, cons_bar) = \
                scratch
        elif direct:   # the tile ring alone: the producer's registers are the staging
            (q_smem, ring, x_s, idx_smem), (q_bar, idx_bar), (full_bars, empty_bars, cons_bar) = scratch
        elif fp8 and split_d:
            (q_smem, tile, nope_st, rope_st, scale_st, x_s, idx_smem), (q_bar, idx_bar), \
                (full_bars, empty_bars, cons_bar) = scratch
        elif fp8:
            (q_smem, tile, nope_st, rope_st, scale_st, idx_smem, vec_smem), (q_bar, idx_bar), \
                (full_bars, empty_bars, cons_bar) = scratch
        elif split_scores and diag == "ss_tail":   # the session-10 layout: exchange buffers after the barriers
            (q_smem, ring, idx_smem, vec_smem), (q_bar, idx_bar, full_bars), (empty_bars, cons_bar), \
                (x_p, x_m, x_l) = scratch
        elif split_scores:
            (q_smem, ring, x_p, x_m, x_l, idx_smem, vec_smem), (q_bar, idx_bar, full_bars), \
                (empty_bars, cons_bar) = scratch
        elif split_d:
            (q_smem, ring, x_s, idx_smem), (q_bar, idx_bar, full_bars), (empty_bars, cons_bar) = scratch
        elif asym:   # x_p: P per ring slot (the helper's wgmma A operand); x_a: alpha per slot, then 1 / l
            (q_smem, ring, x_p, idx_smem, vec_smem, x_a), (q_bar, idx_bar, full_bars), (empty_bars, cons_bar) = \
                scratch
        else:
            (q_smem, ring, idx_smem, vec_smem), (q_bar, idx_bar, full_bars), (empty_bars, cons_bar) = scratch
        index, i32, f32, bf16 = ir.IndexType.get(), ir.IntegerType.get_signless(32), ir.F32Type.get(), ir.BF16Type.get()
        f16_ty = ir.F16Type.get()
        op_ty = f16_ty if f16 else bf16   # the tensor cores' operand type: q, the tiles, P
        if split_d:
            # sinks | lse live in the first 128 floats of the exchange buffer: the sinks are read before the first
            # step (a barrier precedes every write to the buffer) and rewritten, with the lse, after the last one.
            # This keeps a one-split CSA row (640 index rows) within shared memory next to the 32 KB buffer.
            vec_smem = mu.memref_slice(mu.memref_reshape(mu.memref_slice(x_s, (0, 0, 0)), (256,)),
                                       mu.ds(0, 2 * BLOCK_H))
        i8, i16, i64 = (ir.IntegerType.get_signless(n) for n in (8, 16, 64))
        c = lambda v: arith.constant(index, v)
        ci = lambda v: arith.constant(i32, v)
        cta_x = gpu.block_id(gpu.Dimension.x)
        if n_hg == 1:
            row, hg = cta_x, c(0)
        else:
            row, hg = arith.divui(cta_x, c(n_hg)), arith.remui(cta_x, c(n_hg))
        split = gpu.block_id(gpu.Dimension.y)
        wg = mu.warpgroup_idx(sync=True)
        one = mu.single_thread_predicate(mu.ThreadSubset.WARPGROUP)

        def begin(name):   # a profiler region, open until end(); emits nothing unless the kernel is profiled
            region = ctx.named_region(name)
            region.__enter__()
            return region

        def end(region):
            region.__exit__(None, None, None)

        # per source: this CTA's block range [lo, hi) and the first block held in idx_smem (all roles compute it)
        ranges, lengths = [], []
        base = 0
        for k, s_ in enumerate(srcs):
            nb = s_["k"] // bk
            # the row's valid length as given (any int32): clamped to [0, K] here, not by an XLA pass
            length = arith.maxsi(c(0), arith.minsi(arith.index_cast(index, memref.load(src_gmem[k][1], [row])),
                                                   c(s_["k"])))
            lengths.append(length)
            nb_valid = arith.divui(arith.addi(length, c(bk - 1)), c(bk))
            first = arith.subi(arith.muli(split, c(bps)), c(base))      # may be "negative" (wraps): clamp as signed
            clamp = lambda v, hi_: arith.maxsi(c(0), arith.minsi(v, hi_))
            lo = clamp(first, nb_valid)
            hi = clamp(arith.addi(first, c(bps)), nb_valid)
            start = clamp(first, c(nb - idx_rows[k] // bk))
            ranges.append((lo, hi, start))
            base += nb

        def names_row(k, e, pos):
            """Whether entry e (i32) at position pos (index) of source k's list names a row to attend to:
            0 <= e < n_rows and pos < the row's length."""
            return arith.andi(arith.andi(arith.cmpi(arith.CmpIPredicate.sge, e, ci(0)),
                                         arith.cmpi(arith.CmpIPredicate.slt, e, ci(srcs[k]["n_rows"]))),
                              arith.cmpi(arith.CmpIPredicate.slt, pos, lengths[k]))

        def entry(k, i):
            """Entry i (index) of source k's rows in idx_smem -> (index e as i32, `names_row` of it)."""
            e = memref.load(idx_smem, [arith.addi(c(idx_base[k]), i)])
            return e, names_row(k, e, arith.addi(arith.muli(ranges[k][2], c(bk)), i))

        def row_of(k, i):
            """Entry i's row to copy (index): invalid entries copy row 0 (never out of bounds; the consumers mask
            them out)."""
            e, ok = entry(k, i)
            return arith.index_cast(index, arith.select(ok, e, ci(0)))

        def steps(fn, carry, init=None):
            """Runs fn(k, j, g, carry) over the step sequence; g counts steps across the sources. init(k, carry):
            the carry source k's steps start from (None: the previous source's)."""
            g = c(0)
            for k in range(n_src):
                lo, hi, start = ranges[k]
                n = arith.maxsi(arith.subi(hi, lo), c(0))
                if init is not None:
                    carry = init(k, carry)

                @mu.fori(n, (g, carry))
                def loop(t, gc, k=k, lo=lo):
                    g_, cr = gc
                    return arith.addi(g_, c(1)), fn(k, arith.addi(lo, t), g_, cr)

                g, carry = loop.results
            return carry

        def cluster_sync():
            """barrier.cluster (all threads of the row's split CTAs): release our shared-memory writes to the
            cluster, acquire theirs. Not the .aligned form: the producer's threads reach it from divergent code."""
            llvm.inline_asm(ir.Type.parse("!llvm.void"), [], "barrier.cluster.arrive.release;\n"
                            "barrier.cluster.wait.acquire;", "", has_side_effects=True)

        f8_16 = ir.VectorType.get((16,), ir.Float8E4M3FNType.get())

        def store16(val, r, cc, dst, lead):
            """8 bf16 (16 B: columns 8 cc .. 8 cc + 7 of KV row r) into the tile `dst` at the place wgmma reads them
            from: (8, tc) tiles of swz-byte rows, and within a tile row the 16 B chunk j goes to j ^ (r % 8) (128 B
            swizzle) or j ^ ((r % 8) // 2) (64 B). lead: dst's leading indices (the pdq tile ring's slot)."""
            per = swz // 16                                           # 16 B chunks per tile row
            r8 = arith.remui(r, c(8))
            pattern = r8 if swz == 128 else arith.divui(r8, c(2))
            j = arith.xori(arith.remui(cc, c(per)), pattern)
            vector.store(val, dst, [*lead, arith.divui(r, c(8)), arith.divui(cc, c(per)), r8, arith.muli(j, c(8))],
                         alignment=16)

        def chunk_coords(v, ncb, order=None):
            """(row, chunk) of chunk v of a [bk, ncb] grid of 16 B chunks. "rows": row-major, v // ncb, v % ncb.
            "diagonal": the 8 threads of a 16-byte access phase (v % 8 = i) take rows 8 a + i and chunks (b + i) % ncb
            of one 8-row group a (v // 8 = b x bk / 8 + a), a bijection onto the grid. Shared memory serves a phase's
            8 x 16 B in one wavefront only if they fall into 8 different 16-byte slots of the 128-byte bank row:
            row-major, a phase's stores of one row into the swizzled tile hit 2 slots (64 B swizzle: 4-way
            conflict) or 4 (128 B: 2-way); diagonal, the 8 rows' swizzle patterns spread them over all 8, and the
            staging loads (consecutive chunks, rows 512 B apart) stay in 8 slots except where b + i wraps."""
            if (order or chunk_order) == "rows":
                return arith.divui(v, c(ncb)), arith.remui(v, c(ncb))
            i, g = arith.remui(v, c(8)), arith.divui(v, c(8))
            r = arith.addi(arith.muli(arith.remui(g, c(bk // 8)), c(8)), i)
            cb = arith.addi(arith.divui(g, c(bk // 8)), i)   # < ncb + 8
            if ncb < 8:   # (fp8_overlap's 4-chunk pieces) more than one wrap
                return r, arith.remui(cb, c(ncb))
            return r, arith.select(arith.cmpi(arith.CmpIPredicate.uge, cb, c(ncb)), arith.subi(cb, c(ncb)), cb)

        def owned_coords(lt, p, ncb):
            """chunk_order="owned" (the tile ring's 32-row steps, 128 converting threads): thread lt owns row lt // 4
            and its chunks lt % 4 + 4 g, g < ncb / 4, taking g = (p + row % 2) % (ncb / 4) in pass p (static), so
            the two rows of a 16-byte phase load from opposite halves of the bank row (staged rows are 512 B / 128
            B apart: the same banks). -> (row, chunk). Its addresses are a few shifts from lt, no division."""
            n_g = ncb // 4
            r = arith.divui(lt, c(4))
            g = arith.addi(arith.remui(r, c(2)), c(p))
            if p + 1 >= n_g:   # (only the last pass can wrap)
                g = arith.select(arith.cmpi(arith.CmpIPredicate.uge, g, c(n_g)), arith.subi(g, c(n_g)), g)
            return r, arith.addi(arith.remui(lt, c(4)), arith.muli(g, c(4)))

        def load_chunk(slot, v, ncb, cb0, at=None):
            """Nope chunk v of a [bk, ncb] grid of 16 B chunks (from chunk cb0 of each row) of staging slot `slot`
            (at: its (row, chunk) given instead): (row, chunk, its 16 e4m3 as 4 x i32, its 64-column block's scale
            byte as i32)."""
            r, cb = chunk_coords(v, ncb) if at is None else at
            cb = arith.addi(cb, c(cb0) if isinstance(cb0, int) else cb0)
            raw = vector.bitcast(ir.VectorType.get((4,), i32),
                                 vector.load(f8_16, nope_st, [slot, r, arith.muli(cb, c(16))], alignment=16))
            sbyte = arith.extui(i32, memref.load(scale_st, [slot, r, arith.divui(cb, c(4))]))
            return r, cb, raw, sbyte

        def convert_chunk(slot, v, ncb, cb0, dst=None, lead=()):
            """Nope chunk v of a [bk, ncb] grid of 16 B chunks (from chunk cb0 of each row) of staging slot `slot`:
            16 e4m3 -> 16 bf16 x the chunk's 64-column block scale, into the tile (default: the consumers' tile)."""
            store_chunk(load_chunk(slot, v, ncb, cb0), dst, lead)

        def store_chunk(loaded, dst=None, lead=(), swap=None):
            """A loaded chunk (load_chunk) converted and stored into the tile (default: the consumers' tile). swap
            (i1, chunk_order="owned"): store the chunk's upper 16 B first (its raw words swapped before converting),
            so the four threads of a row hit four different 16-byte slots in each store instead of two."""
            r, cb, raw, sbyte = loaded
            if swap is not None:
                w_ = [vector.extract(raw, [], [w]) for w in range(4)]
                w_ = [arith.select(swap, w_[(w + 2) % 4], w_[w]) for w in range(4)]
                raw = vector.from_elements(ir.VectorType.get((4,), i32), w_)
            words = []
            if diag == "no_convert":   # timing diagnostic only (wrong values): raw bytes stored as if bf16
                words = [vector.extract(raw, [], [w % 4]) for w in range(8)]
            elif diag == "bits":       # integer bit placement + 2 bf16 multiplies: exact, measured slower
                # 2^k as a bf16 pair: the ue8m0 byte is the bf16 exponent field
                s2 = arith.ori(arith.shli(sbyte, ci(23)), arith.shli(sbyte, ci(7)))
                for w in range(4):
                    pair = llvm.inline_asm(ir.Type.parse("!llvm.struct<(i32, i32)>"),
                                           [vector.extract(raw, [], [w]), s2], BITS_ASM, "=r,=r,r,r")
                    words += [llvm.extractvalue(i32, pair, [0]), llvm.extractvalue(i32, pair, [1])]
            elif f16:                  # e4m3x2 -> f16x2, x 2^e1, x 2^(k - e1) (F16_CVT_ASM)
                k_ = arith.subi(sbyte, ci(127))
                e1 = arith.maxsi(ci(-14), arith.minsi(k_, ci(15)))
                s1 = arith.muli(arith.shli(arith.addi(e1, ci(15)), ci(10)), ci(0x10001))   # 2^e1 as an f16 pair
                s2f = arith.bitcast(f32, arith.shli(arith.addi(arith.subi(k_, e1), ci(127)), ci(23)))
                s2 = llvm.inline_asm(i32, [s2f], "cvt.rn.f16x2.f32 $0, $1, $1;", "=r,f")   # 2^(k - e1), rounded
                for w in range(4):
                    word = vector.extract(raw, [], [w])
                    for half in (word, arith.shrui(word, ci(16))):
                        words.append(llvm.inline_asm(i32, [arith.trunci(i16, half), s1, s2], F16_CVT_ASM,
                                                     "=r,h,r,r"))
            elif fp8_convert == "rebias":   # e4m3x2 -> f16x2, bits re-biased to bf16, 2 bf16 multiplies
                e = arith.subi(sbyte, ci(15))                       # 112 + k, k = byte - 127
                ea = arith.shrsi(e, ci(1))
                pair = lambda x: arith.muli(arith.shli(arith.addi(x, ci(127)), ci(7)), ci(0x10001))
                pa, pb = pair(ea), pair(arith.subi(e, ea))          # 2^a, 2^b as bf16 pairs
                for w in range(4):
                    word = vector.extract(raw, [], [w])
                    for half in (word, arith.shrui(word, ci(16))):
                        words.append(llvm.inline_asm(i32, [arith.trunci(i16, half), pa, pb], REBIAS_ASM,
                                                     "=r,h,r,r"))
            else:                      # hardware conversions: e4m3x2 -> f16x2 -> 2 x f32, x 2^k, -> bf16x2
                sf = arith.bitcast(f32, arith.shli(sbyte, ci(23)))   # ue8m0 byte b -> 2^(b - 127)
                for w in range(4):
                    word = vector.extract(raw, [], [w])
                    for half in (word, arith.shrui(word, ci(16))):
                        words.append(llvm.inline_asm(i32, [arith.trunci(i16, half), sf], CVT_ASM, "=r,h,f"))
            for h in range(2):   # 16 bf16 (f16) = the 16 B chunks 2 cb, 2 cb + 1 of the row
                val = vector.bitcast(ir.VectorType.get((8,), op_ty),
                                     vector.from_elements(ir.VectorType.get((4,), i32), words[4 * h: 4 * h + 4]))
                hh = c(h) if swap is None else arith.index_cast(index, arith.xori(
                    arith.extui(i32, swap), ci(h)))
                store16(val, r, arith.addi(arith.muli(cb, c(2)), hh), tile if dst is None else dst, lead)

        def load_rope(slot, v, at=None):   # rope chunk v (or at (row, chunk)): 8 16-byte chunks per row, already
            # bf16 -> (row, chunk, value). Row-major is conflict-free under the 128 B swizzle (a row's 8 chunks land
            # in 8 slots); the 64 B swizzle takes the diagonal order's 8 rows for that
            r, ch = (chunk_coords(v, 8, None if swz == 64 else "rows") if at is None else at)
            return r, ch, vector.load(ir.VectorType.get((8,), bf16), rope_st, [slot, r, arith.muli(ch, c(8))],
                                      alignment=16)

        def to_f16(val):
            """vector<8 x bf16> -> vector<8 x f16> (BF16_TO_F16_ASM on each pair)."""
            words = vector.bitcast(ir.VectorType.get((4,), i32), val)
            words = [llvm.inline_asm(i32, [vector.extract(words, [], [w])], BF16_TO_F16_ASM, "=r,r")
                     for w in range(4)]
            return vector.bitcast(ir.VectorType.get((8,), f16_ty),
                                  vector.from_elements(ir.VectorType.get((4,), i32), words))

        def store_rope(loaded, dst=None, lead=()):
            r, ch, val = loaded
            if f16:
                val = to_f16(val)
            store16(val, r, arith.addi(ch, c(NOPE_DIM // 8)), tile if dst is None else dst, lead)

        def copy_rope(slot, v, dst=None, lead=()):
            store_rope(load_rope(slot, v), dst, lead)

        def convert_step(gs, tag, release, units=(0, CONV_UNITS)):
            """pdq / conv: staged step gs (staging slot gs % stages) -> bf16 tile gs % n_tiles, by the 128 threads
            of the converting warpgroup (the producer with pdq, wg 3 with conv), once its copies have landed and both
            consumers are past the tile's previous step (P.V included). Each thread fences its stores for the async
            proxy (wgmma) and arrives on the tile's full barrier (128 arrivals per converting warpgroup); release(s_)
            then frees the staging slot (pdq: a warpgroup barrier before the producer's next issue; conv: 128
            arrivals on st_empty). units [u0, u1): this warpgroup's share of the step's CONV_UNITS passes of 128
            chunks, the nope passes (bk * 28 / 128 of them) first, then the rope passes (bk * 8 / 128): with
            conv_units < CONV_UNITS the converter takes [0, conv_units) and the producer the rest."""
            lt = arith.remui(arith.index_cast(index, mu.thread_idx()), c(128))
            s_, t_ = arith.remui(gs, c(stages)), arith.remui(gs, c(n_tiles))
            region = begin(f"{tag}_wait_staged")
            st_bars[s_].wait()
            end(region)
            region = begin(f"{tag}_wait_tile")
            with mu.when(arith.cmpi(arith.CmpIPredicate.uge, gs, c(n_tiles))):
                empty_bars[t_].wait()
            end(region)
            region = begin(f"{tag}_convert")
            ncb = NOPE_DIM // 16                 # 28 nope chunks of 16 e4m3 per row
            n_nope = bk * ncb // 128             # nope passes (7 at bk = 32), then rope passes (2)
            u0, u1 = units
            a, b_ = min(u0, n_nope), min(u1, n_nope)
            rope_passes = range(max(u0, n_nope) - n_nope, u1 - n_nope)   # rope: 8 chunks of 8 bf16 per row, copied
            owned = chunk_order == "owned"
            if conv_batch == 1 and not owned:   # a loop, one chunk at a time: each chunk's loads wait for the
                # previous stores
                if b_ > a:
                    @mu.fori(c(b_ - a), None)
                    def _(i, _c):
                        convert_chunk(s_, arith.addi(lt, arith.muli(arith.addi(i, c(a)), c(128))), ncb, 0, ring,
                                      (t_,))
                        return _c

                for i in rope_passes:
                    copy_rope(s_, arith.addi(lt, c(128 * i)), ring, (t_,))
            else:   # unrolled in batches: a batch's loads all issue before its first store (shared-memory stores
                # and loads may alias, so the compiler keeps them in program order; one chunk at a time, every
                # chunk pays the whole load -> convert -> store latency)
                # (chunk_order="owned": always unrolled, its passes' coordinates static offsets of lt's)
                passes = [("nope", p) for p in range(a, b_)] + [("rope", p) for p in rope_passes]
                # owned: a thread's rows' two 16 B halves stored upper first where lt % 4 >= 2 (see store_chunk)
                swap = arith.cmpi(arith.CmpIPredicate.uge, arith.remui(lt, c(4)), c(2)) if owned else None

                def load(kind, p):
                    v = arith.addi(lt, c(128 * p))
                    if kind == "nope":
                        return load_chunk(s_, v, ncb, 0, owned_coords(lt, p, ncb) if owned else None)
                    return load_rope(s_, v, owned_coords(lt, p, 8) if owned else None)

                for i0 in range(0, len(passes), conv_batch):
                    batch = passes[i0:i0 + conv_batch]
                    loaded = [load(kind, p) for kind, p in batch]
                    for (kind, _p), ld in zip(batch, loaded):
                        if kind == "nope":
                            store_chunk(ld, ring, (t_,), swap)
                        else:
                            store_rope(ld, ring, (t_,))
            nvvm.fence_proxy(nvvm.ProxyKind.async_shared, space=nvvm.SharedSpace.shared_cta)  # st.shared -> wgmma
            full_bars[t_].arrive()
            release(s_)
            end(region)

        def total_steps():
            """This CTA's step count (index): its blocks of every source, as `steps` visits them."""
            total = c(0)
            for lo_, hi_, _ in ranges:
                total = arith.addi(total, arith.maxsi(arith.subi(hi_, lo_), c(0)))
            return total

        is_producer = arith.cmpi(arith.CmpIPredicate.eq, wg, ci(2))
        if_op = scf.IfOp(is_producer, has_else=True)
        with ir.InsertionPoint(if_op.then_block):   # ---------------- producer ----------------
            nvvm.setmaxregister(regs[0], nvvm.SetMaxRegisterAction.decrease)
            region = begin("p_setup")   # q, sinks and this split's index rows in flight; until the rows landed

            def load_q():
                q_bar.arrive_expect_tx(BLOCK_H * d * 2 + BLOCK_H * 4, predicate=one)
                ctx.async_copy(src_ref=q_gmem, dst_ref=q_smem, gmem_slice=(row, hg),
                               gmem_transform=mgpu.TileTransform((8, tc)), swizzle=swz, barrier=q_bar, arrive=False,
                               predicate=one)
                ctx.async_copy(src_ref=sink_gmem, dst_ref=mu.memref_slice(vec_smem, mu.ds(0, BLOCK_H)),
                               gmem_slice=(hg,), barrier=q_bar, arrive=False, predicate=one)

            def load_idx():
                idx_bar.arrive_expect_tx(sum(idx_rows) * 4, predicate=one)
                for k in range(n_src):
                    start = ranges[k][2]
                    for c0 in range(0, idx_rows[k], 256):   # a bulk copy moves <= 256 elements along a dimension
                        w = min(256, idx_rows[k] - c0)
                        ctx.async_copy(src_ref=src_gmem[k][0],
                                       dst_ref=mu.memref_slice(idx_smem, mu.ds(idx_base[k] + c0, w)),
                                       gmem_slice=(row, mu.ds(arith.addi(arith.muli(start, c(bk)), c(c0)), w)),
                                       barrier=idx_bar, arrive=False, predicate=one)

            ptid = arith.remui(arith.index_cast(index, mu.thread_idx()), c(128))
            if idx_ring:   # streamed index rows: each step loads and cleans its own (see produce)
                load_q()
            else:
                # idx_first: the few KB of index rows ahead of the 64 KB q tile, so the first gathers need not wait
                # for q to stream in at the SM's ~14 B per cycle (the gathers need the rows, not q)
                for load in ((load_idx, load_q) if idx_first else (load_q, load_idx)):
                    load()
                idx_bar.wait()
                # the index lists as given: entries outside [0, n_rows) or at positions >= the row's length become
                # -1 here, in shared memory, for the consumers' masks (one pass of the 128 producer threads, no XLA
                # kernel before the call); then named barrier 9 (the 384 threads) releases the consumers. The issue
                # loop below tests the entries itself, so the producer needs no barrier of its own.
                for k in range(n_src):
                    @mu.fori(c(-(-idx_rows[k] // 128)), None)
                    def _(it, _c, k=k):
                        i = arith.addi(arith.muli(it, c(128)), ptid)
                        with mu.when(arith.cmpi(arith.CmpIPredicate.ult, i, c(idx_rows[k]))):
                            e, ok = entry(k, i)
                            memref.store(arith.select(ok, e, ci(-1)), idx_smem, [arith.addi(c(idx_base[k]), i)])
                        return _c
            llvm.inline_asm(ir.Type.parse("!llvm.void"), [], "bar.arrive 9, 384;", "", has_side_effects=True)
            end(region)
            lane0 = mu.single_thread_predicate(mu.ThreadSubset.WARP)
            warp = arith.remui(arith.index_cast(index, mu.warp_idx(sync=True)), c(4))

            if fp8 and not direct:
                scale_st_ptr = mu.memref_ptr(scale_st)
            if fp8:
                scale_gptrs = [llvm.addrspacecast(llvm.PointerType.get(address_space=1), mu.memref_ptr(src_gmem[k][4]))
                               for k in range(n_src)]

            def copy_piece(k, slot, full, r, e, p):
                """bf16: issue piece p (swz bytes) of row e of source k's pool into row r of ring slot `slot`, the
                (8, tc)-tiled, swz-swizzled place wgmma reads it from (lane 0 of each warp)."""
                ctx.async_copy(src_ref=src_gmem[k][2],
                               dst_ref=mu.memref_slice(ring, (slot, arith.divui(r, c(8)), p,
                                                              mu.ds(arith.remui(r, c(8)), 1))),
                               gmem_slice=(mu.ds(e, 1), mu.ds(p * tc if isinstance(p, int) else arith.muli(p, c(tc)),
                                                                tc)), swizzle=swz, barrier=full,
                               arrive=False, predicate=lane0)

            def copy_row(k, slot, full, r, e, piece_bar=None):
                """Issue row e of source k's pool into row r of ring / staging slot `slot` (lane 0 of each warp), on
                barrier `full`, or with piece_bars piece p on piece_bar(p)."""
                if not fp8:   # d / tc pieces of swz bytes into the (8, tc)-tiled, swz-swizzled ring
                    for p in range(pieces):
                        copy_piece(k, slot, full if piece_bar is None else piece_bar(p), r, e, p)
                    return
                # FP8 raw row: nope (2 tensor copies, 256 + 192 B; "bulk": 1), rope (1 copy), and the 8 scale bytes
                # (cp.async, tracked by the slot's barrier through cp.async.mbarrier.arrive.noinc after the row loop)
                if fp8_copy == "bulk":
                    copy_fp8_row_bulk(k, slot, full, r, e)
                else:
                    for c0, w in ((0, 256), (256, NOPE_DIM - 256)):         # a tensor copy moves <= 256 elements
                        ctx.async_copy(src_ref=src_gmem[k][2],
                                       dst_ref=mu.memref_slice(nope_st, (slot, mu.ds(r, 1), mu.ds(c0, w))),
                                       gmem_slice=(mu.ds(e, 1), mu.ds(c0, w)), barrier=full, arrive=False,
                                       predicate=lane0)
                    ctx.async_copy(src_ref=src_gmem[k][3], dst_ref=mu.memref_slice(rope_st, (slot, mu.ds(r, 1))),
                                   gmem_slice=(mu.ds(e, 1), mu.ds(0, ROPE_DIM)), barrier=full, arrive=False,
                                   predicate=lane0)
                with mu.when(arith.andi(lane0, arith.constant(ir.IntegerType.get_signless(1), diag != "no_scales"))):
                    dst = mu.getelementptr(scale_st_ptr, [arith.index_cast(i32, arith.addi(
                        arith.muli(slot, c(bk * 8)), arith.muli(r, c(8))))], i8)
                    src = mu.getelementptr(scale_gptrs[k], [arith.index_cast(i64, arith.muli(e, c(8)))], i8)
                    nvvm.cp_async_shared_global(dst, src, 8, nvvm.LoadCacheModifierKind.CA)

            if fp8_copy == "bulk":   # 1-D bulk copies (no tensor map): shared::cta and global addresses as integers
                bulk_gptrs = [[llvm.ptrtoint(i64, llvm.addrspacecast(llvm.PointerType.get(address_space=1),
                                                                      mu.memref_ptr(src_gmem[k][part])))
                               for part in (2, 3)] for k in range(n_src)]
                nope_st_base = llvm.ptrtoint(i32, mu.memref_ptr(nope_st))
                rope_st_base = llvm.ptrtoint(i32, mu.memref_ptr(rope_st))

            def copy_fp8_row_bulk(k, slot, full, r, e):
                """fp8_copy "bulk": row e of source k's pool into row r of staging slot `slot` as two 1-D bulk
                copies (448 nope bytes, 128 rope bytes: 16 B multiples at 16 B aligned addresses on both sides) by
                lane 0, completing on `full`'s transaction count (copy_row adds the scale bytes)."""
                at = arith.index_cast(i64, e)
                sr = arith.index_cast(i32, arith.addi(arith.muli(slot, c(bk)), r))   # the slot's row
                bar = llvm.ptrtoint(i32, full.get_ptr())
                for gbase, sbase, n in ((bulk_gptrs[k][0], nope_st_base, NOPE_DIM),
                                        (bulk_gptrs[k][1], rope_st_base, 2 * ROPE_DIM)):
                    dst = arith.addi(sbase, arith.muli(sr, ci(NOPE_STRIDE if n == NOPE_DIM else n)))
                    src = arith.addi(gbase, arith.muli(at, arith.constant(i64, n)))
                    llvm.inline_asm(ir.Type.parse("!llvm.void"), [lane0, dst, src, bar],
                                    f"@$0 cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$1], [$2], "
                                    f"{n}, [$3];", "b,r,l,r", has_side_effects=True)

            if direct:
                nope_gptrs, rope_gptrs = ([llvm.addrspacecast(llvm.PointerType.get(address_space=1),
                                                              mu.memref_ptr(src_gmem[k][part])) for k in range(n_src)]
                                          for part in (2, 3))
                v4i32 = ir.VectorType.get((4,), i32)

            def opaque_in_step(v, g):
                """v (index) as an opaque function of step g: what is computed from it cannot be hoisted out of the
                step loop, where ptxas would keep (and spill) it live through the loop."""
                return arith.index_cast(index, llvm.inline_asm(
                    i32, [arith.index_cast(i32, v), arith.index_cast(i32, g)], "mov.b32 $0, $1;", "=r,r,r"))

            def step_tid(g):
                """direct: this producer thread's index, opaque in step g. Every chunk's coordinates (row, chunk,
                offsets) depend only on it and the pass; hoisted out of the step loop they are dozens of values live
                through it, which spills the producer's 80 registers (offline ptxas, session 55)."""
                return opaque_in_step(ptid, g)

            def direct_load(k, kind, p, src_row, lt):
                """direct: pass p of a step (128 chunks of 16 B; the nope passes first, then the rope passes) for
                this thread, loaded from global memory at its row's address. Nope: (row, chunk, 16 e4m3 as 4 x i32,
                the chunk's 64-column scale byte as i32), as load_chunk returns from staging; rope: (row, chunk, 8
                bf16), as load_rope. Invalid entries read row 0 (src_row), which the consumers mask out."""
                v = arith.addi(lt, c(128 * p))
                if kind == "nope":
                    r, cb = chunk_coords(v, NOPE_DIM // 16)
                    e = arith.index_cast(i64, src_row(r))
                    at = arith.addi(arith.muli(e, arith.constant(i64, NOPE_DIM)),
                                    arith.index_cast(i64, arith.muli(cb, c(16))))
                    raw = llvm.load(v4i32, mu.getelementptr(nope_gptrs[k], [at], i8), alignment=16)
                    s_at = arith.addi(arith.muli(e, arith.constant(i64, SCALE_BYTES)),
                                      arith.index_cast(i64, arith.divui(cb, c(4))))
                    sbyte = arith.extui(i32, llvm.load(i8, mu.getelementptr(scale_gptrs[k], [s_at], i8)))
                    return r, cb, raw, sbyte
                r, ch = chunk_coords(v, ROPE_DIM // 8, "rows")   # a warp's 32 threads: 4 whole 128 B rows
                e = arith.index_cast(i64, src_row(r))
                at = arith.addi(arith.muli(e, arith.constant(i64, ROPE_DIM * 2)),
                                arith.index_cast(i64, arith.muli(ch, c(16))))
                raw = llvm.load(v4i32, mu.getelementptr(rope_gptrs[k], [at], i8), alignment=16)
                return r, ch, vector.bitcast(ir.VectorType.get((8,), bf16), raw)

            def direct_step(k, g, src_row):
                """direct: step g of source k gathered, converted and stored into tile g % n_tiles. The first batch
                of loads is issued before the wait for the tile (the loads need the rows, not the tile), so its
                latency runs under that wait; each later batch's loads are issued after the previous batch's
                stores (conv_batch chunks of 16 B live at once). Then each thread fences its stores for the async
                proxy (wgmma) and arrives on the tile's full barrier (128 arrivals)."""
                t_ = arith.remui(g, c(n_tiles))
                lt = step_tid(g)
                n_nope, n_rope = bk * (NOPE_DIM // 16) // 128, bk * (ROPE_DIM // 8) // 128
                passes = [("nope", p_) for p_ in range(n_nope)] + [("rope", p_) for p_ in range(n_rope)]
                batches = [passes[i:i + conv_batch] for i in range(0, len(passes), conv_batch)]
                region = begin("p_load")
                loaded = [direct_load(k, kind, p_, src_row, lt) for kind, p_ in batches[0]]
                end(region)
                region = begin("p_wait_tile")
                with mu.when(arith.cmpi(arith.CmpIPredicate.uge, g, c(n_tiles))):
                    empty_bars[t_].wait()
                end(region)
                region = begin("p_convert")
                for bi, batch in enumerate(batches):
                    if bi:
                        loaded = [direct_load(k, kind, p_, src_row, lt) for kind, p_ in batch]
                    for (kind, _p), ld in zip(batch, loaded):
                        (store_chunk if kind == "nope" else store_rope)(ld, ring, (t_,))
                nvvm.fence_proxy(nvvm.ProxyKind.async_shared, space=nvvm.SharedSpace.shared_cta)  # st.shared -> wgmma
                full_bars[t_].arrive()
                end(region)

            if direct_tile:
                tile_ptr = mu.memref_ptr(ring)
                raw_p0 = DIRECT_RAW_PIECE                 # the raw nope rows' first piece (8 chunks a piece)
                n_low = raw_p0 * 4                        # chunks converted from the raw area (pieces < raw_p0)
                n_high = NOPE_DIM // 16 - n_low           # chunks held in registers across the barrier
                # the scales' 16 B slot in the raw area's last piece: the first one chunks 24-27 leave free (as
                # chunk 28 would sit, XOR-ed with the row like the chunks)
                scale_at = ((NOPE_DIM // 16) % 8) * 16

            def direct_prefetch_next(k, j, nxt):
                """direct_prefetch: the raw rows of block j + 1 of source k (if that block is this CTA's) into L2, by
                `prefetch.global.L2` of their 128 B lines. With the split's whole index lists in shared memory, thread
                t takes entry t % bk, half of its row's lines; with idx_ring (nxt: this thread's entry of that block,
                loaded from global memory a step ahead, t < bk) threads t < bk take every line of theirs. (A bulk
                prefetch per row part takes uniform operands, so ptxas loops over a warp's addresses: 10-26% slower
                on the H100, session 55.)"""
                has_next = arith.cmpi(arith.CmpIPredicate.slt, arith.addi(j, c(1)), ranges[k][1])
                streamed = nxt is not None
                lane = ptid if streamed else arith.remui(ptid, c(bk))
                cond = arith.andi(has_next, arith.cmpi(arith.CmpIPredicate.ult, ptid, c(bk))) if streamed else has_next
                with mu.when(cond):
                    if streamed:
                        e, ok = nxt, names_row(k, nxt, arith.addi(arith.muli(arith.addi(j, c(1)), c(bk)), lane))
                    else:
                        e, ok = entry(k, arith.addi(arith.muli(arith.subi(arith.addi(j, c(1)), ranges[k][2]), c(bk)),
                                                    lane))
                    with mu.when(ok):
                        e64 = arith.extsi(i64, e)

                        def prefetch(base, row_bytes, byte):
                            addr = mu.getelementptr(base, [arith.addi(arith.muli(e64, arith.constant(i64, row_bytes)),
                                                                      arith.constant(i64, byte))], i8)
                            llvm.inline_asm(ir.Type.parse("!llvm.void"), [llvm.ptrtoint(i64, addr)],
                                            "prefetch.global.L2 [$0];", "l", has_side_effects=True)

                        nope_lines = (0, 128, 256, 384, NOPE_DIM - 1)   # the 448 B row spans up to 5 lines
                        halves = [nope_lines] if streamed else [nope_lines[:3], nope_lines[3:]]
                        for hh, offs in enumerate(halves):
                            with (mu.when(arith.cmpi(arith.CmpIPredicate.eq, arith.divui(ptid, c(bk)), c(hh)))
                                  if len(halves) > 1 else contextlib.nullcontext()):
                                for o in offs:
                                    prefetch(nope_gptrs[k], NOPE_DIM, o)
                                if hh == len(halves) - 1:
                                    prefetch(rope_gptrs[k], ROPE_DIM * 2, 0)
                                    prefetch(scale_gptrs[k], SCALE_BYTES, 0)

            def direct_tile_step(k, g, src_row):
                """direct_tile: step g of source k, staged in tile g % n_tiles itself (see _build's direct_tile).
                Thread t works on row t % 64 alone, half h = t // 64 of it (h is warp-uniform): one index load a step,
                copies at fixed offsets from the row's addresses. Raw nope chunk c of row r sits at byte
                16 ((c % 8) ^ (r % 8)) of r's 128 B slot in piece DIRECT_RAW_PIECE + c // 8 (the XOR keeps a
                copy's and a read's 8 rows of a shared-memory phase on 8 distinct 16-byte slots), the row's 8 scale
                bytes after chunks 24-27. Then: the copies land (cp.async wait + warpgroup barrier); each thread
                reads its row's chunks bound for pieces >= DIRECT_RAW_PIECE into registers and converts the others
                (chunks h, h + 2, ..: 8 consecutive rows, one chunk, per phase: conflict-free for the swizzled
                stores too); a warpgroup barrier; it stores the held ones over the raw area; proxy fence; the
                tile's full barrier (128 arrivals)."""
                t_ = arith.remui(g, c(n_tiles))
                lt = step_tid(g)
                r = arith.remui(lt, c(bk))
                h = arith.divui(lt, c(bk))
                r8x16 = arith.muli(arith.remui(r, c(8)), c(16))
                row_base = arith.addi(arith.muli(t_, c(bk * d * 2)), arith.addi(
                    arith.muli(arith.divui(r, c(8)), c(pieces * 8 * swz)), arith.muli(arith.remui(r, c(8)), c(swz))))

                def sptr(p_, byte):   # row r's 128 B slot of piece p_ of the tile, + byte (index)
                    return mu.getelementptr(tile_ptr, [arith.index_cast(i32, arith.addi(
                        row_base, arith.addi(c(p_ * 8 * swz), byte)))], i8)

                def raw_byte(cc):     # chunk cc's (static) byte in its raw slot
                    return arith.xori(c((cc % 8) * 16), r8x16)

                region = begin("p_wait_tile")
                with mu.when(arith.cmpi(arith.CmpIPredicate.uge, g, c(n_tiles))):
                    empty_bars[t_].wait()
                end(region)
                region = begin("p_issue")
                e = arith.index_cast(i64, src_row(r))
                ncb = NOPE_DIM // 16
                nope_row = mu.getelementptr(nope_gptrs[k], [arith.muli(e, arith.constant(i64, NOPE_DIM))], i8)
                rope_row = mu.getelementptr(rope_gptrs[k], [arith.muli(e, arith.constant(i64, ROPE_DIM * 2))], i8)
                scale_row = mu.getelementptr(scale_gptrs[k], [arith.muli(e, arith.constant(i64, SCALE_BYTES))], i8)
                n_rope = ROPE_DIM // 8
                for hh in range(2):   # warp-uniform branches: static chunk numbers in each
                    with mu.when(arith.cmpi(arith.CmpIPredicate.eq, h, c(hh))):
                        for cc in range(hh * ncb // 2, (hh + 1) * ncb // 2):
                            nvvm.cp_async_shared_global(
                                sptr(raw_p0 + cc // 8, raw_byte(cc)),
                                mu.getelementptr(nope_row, [arith.constant(i64, cc * 16)], i8), 16,
                                nvvm.LoadCacheModifierKind.CG)
                        for j in range(hh * n_rope // 2, (hh + 1) * n_rope // 2):   # rope: its final place
                            nvvm.cp_async_shared_global(
                                sptr(pieces - 1, arith.xori(c(j * 16), r8x16)),
                                mu.getelementptr(rope_row, [arith.constant(i64, j * 16)], i8), 16,
                                nvvm.LoadCacheModifierKind.CG)
                        if hh == 0:
                            nvvm.cp_async_shared_global(sptr(raw_p0 + (ncb - 1) // 8, raw_byte(scale_at // 16)),
                                                        scale_row, 8, nvvm.LoadCacheModifierKind.CA)
                nvvm.cp_async_commit_group()
                end(region)
                region = begin("p_wait_raw")
                nvvm.cp_async_wait_group(0)
                mu.warpgroup_barrier()                    # every thread's copies landed
                end(region)
                region = begin("p_convert")
                scales = llvm.load(i64, sptr(raw_p0 + (ncb - 1) // 8, raw_byte(scale_at // 16)), alignment=8)

                def raw_chunk(i):
                    """Chunk h + 2 i of row r from the raw area: (r, chunk, 4 x i32, its scale byte as i32)."""
                    cb = arith.addi(h, c(2 * i))
                    byte = arith.xori(arith.muli(arith.remui(cb, c(8)), c(16)), r8x16)
                    raw = llvm.load(v4i32, mu.getelementptr(tile_ptr, [arith.index_cast(i32, arith.addi(
                        row_base, arith.addi(arith.muli(arith.addi(c(raw_p0), arith.divui(cb, c(8))), c(8 * swz)),
                                             byte)))], i8), alignment=16)
                    sb = arith.trunci(i32, arith.andi(arith.shrui(scales, arith.index_cast(
                        i64, arith.muli(arith.divui(cb, c(4)), c(8)))), arith.constant(i64, 255)))
                    return r, cb, raw, sb

                held = [raw_chunk(i) for i in range(n_low // 2, ncb // 2)]   # bound for the raw area's pieces
                for i in range(n_low // 2):               # bound for the pieces below it
                    store_chunk(raw_chunk(i), ring, (t_,))
                mu.warpgroup_barrier()                    # the raw area is read: it may be overwritten
                for ld in held:
                    store_chunk(ld, ring, (t_,))
                nvvm.fence_proxy(nvvm.ProxyKind.async_shared, space=nvvm.SharedSpace.shared_cta)  # -> wgmma
                full_bars[t_].arrive()
                end(region)

            if cp_async:
                ring_ptr = mu.memref_ptr(ring)
                pool_gptrs = [llvm.addrspacecast(llvm.PointerType.get(address_space=1), mu.memref_ptr(src_gmem[k][2]))
                              for k in range(n_src)]
                per_piece = swz // 16                # 16 B chunks per piece (tile row)
                chunk = arith.remui(ptid, c(64))     # this thread's 16 B chunk of a row: piece chunk // per_piece
                row_half = arith.divui(ptid, c(64))  # and its rows: 2 i + row_half
                piece_off = arith.muli(arith.divui(chunk, c(per_piece)), c(8 * swz))
                j16 = arith.remui(chunk, c(per_piece))

            def issue_cp_async(k, slot, full, off):
                """Block rows -> ring slot with 16 B cp.async per thread (128 threads: 2 rows per step, 64 chunks
                each), written in the (8, 64)-tiled 128 B-swizzled layout wgmma reads: row r, chunk j of piece p at
                ((r // 8) (d / 64) + p) KB + (r % 8) 128 B + (j ^ (r % 8)) 16 B (64 B swizzle, block_k = 32: (8, 32)
                tiles of 512 B, ((r // 8) (d / 32) + p) 512 B + (r % 8) 64 B + (j ^ ((r // 2) % 4)) 16 B). Each
                thread's copies complete on the slot's barrier (cp.async.mbarrier.arrive.noinc: 128 arrivals)."""
                slot_base = arith.muli(slot, c(bk * d * 2))

                @mu.fori(c(bk // 2), None)
                def _(i, _c):
                    r = arith.addi(arith.muli(i, c(2)), row_half)
                    e = row_of(k, arith.addi(off, r))
                    r8 = arith.remui(r, c(8))
                    pattern = r8 if swz == 128 else arith.remui(arith.divui(r8, c(2)), c(4))   # address bits 7.. -> 4..
                    dst = arith.addi(arith.addi(slot_base, arith.muli(arith.divui(r, c(8)), c(pieces * 8 * swz))),
                                     arith.addi(piece_off, arith.addi(arith.muli(r8, c(swz)),
                                                                      arith.muli(arith.xori(j16, pattern), c(16)))))
                    src = arith.addi(arith.muli(e, c(d * 2)), arith.muli(chunk, c(16)))
                    nvvm.cp_async_shared_global(mu.getelementptr(ring_ptr, [arith.index_cast(i32, dst)], i8),
                                                mu.getelementptr(pool_gptrs[k], [arith.index_cast(i64, src)], i8),
                                                16, nvvm.LoadCacheModifierKind.CG)
                    return _c

                nvvm.cp_async_mbarrier_arrive(full.get_ptr(), noinc=True)

            if l2_ahead:
                row_bytes = [NOPE_DIM if fp8 else d * 2] * n_src   # FP8: the nope part (the rest is small)
                l2_gptrs = [llvm.addrspacecast(llvm.PointerType.get(address_space=1), mu.memref_ptr(src_gmem[k][2]))
                            for k in range(n_src)]
                n_steps = [arith.maxsi(arith.subi(hi_, lo_), c(0)) for lo_, hi_, _ in ranges]

            def prefetch_step(gp):
                """L2 prefetch of the rows of step gp (any step index; nothing past the last): threads 0..bk-1 one
                row each, `cp.async.bulk.prefetch.L2` (no shared memory, no completion to track). Run l2_ahead
                steps ahead of the ring, it keeps more of the gather in flight than the two ring slots hold."""
                first_step = c(0)
                for k in range(n_src):
                    t_ = arith.subi(gp, first_step)
                    inside = arith.andi(arith.cmpi(arith.CmpIPredicate.sge, t_, c(0)),
                                        arith.cmpi(arith.CmpIPredicate.slt, t_, n_steps[k]))
                    with mu.when(arith.andi(inside, arith.cmpi(arith.CmpIPredicate.ult, ptid, c(bk)))):
                        e, ok = entry(k, arith.addi(arith.muli(arith.subi(arith.addi(ranges[k][0], t_),
                                                                          ranges[k][2]), c(bk)), ptid))
                        with mu.when(ok):
                            addr = mu.getelementptr(l2_gptrs[k], [arith.muli(arith.extsi(i64, e), arith.constant(
                                i64, row_bytes[k]))], i8)
                            llvm.inline_asm(ir.Type.parse("!llvm.void"), [llvm.ptrtoint(i64, addr)],
                                            f"cp.async.bulk.prefetch.L2.global [$0], {row_bytes[k]};", "l",
                                            has_side_effects=True)
                    first_step = arith.addi(first_step, n_steps[k])

            for gp in range(stages, stages + l2_ahead):   # the first steps past the ring's initial fill
                prefetch_step(c(gp))

            if idx_ring:
                idx_gptrs = [llvm.addrspacecast(llvm.PointerType.get(address_space=1), mu.memref_ptr(src_gmem[k][0]))
                             for k in range(n_src)]

            def raw_entry(k, j):
                """idx_ring: this thread's entry of block j of source k as given (i32, from global memory; thread
                ptid takes entry ptid, threads past bk re-read the last one)."""
                pos = arith.addi(arith.muli(j, c(bk)), arith.minui(ptid, c(bk - 1)))
                at = arith.addi(arith.muli(row, c(srcs[k]["k"])), pos)
                return llvm.load(i32, mu.getelementptr(idx_gptrs[k], [arith.index_cast(i64, at)], i32))

            def ring_row(u, r):
                """idx_ring: the row to copy for entry r of ring slot u (cleaned: -1 copies row 0, masked out)."""
                e = memref.load(idx_smem, [arith.addi(arith.muli(u, c(bk)), r)])
                return arith.index_cast(index, arith.maxsi(e, ci(0)))

            def produce(k, j, g, carry):
                """Block j of source k into ring / staging slot g % stages, once both consumers are done with it.
                idx_ring: carry = this thread's entry of the step (loaded a step ago); returns the next step's."""
                slot = arith.remui(g, c(stages))
                if idx_ring:   # the next step's entry: its global load flies while this step waits and issues
                    nxt = raw_entry(k, arith.minsi(arith.addi(j, c(1)), arith.subi(ranges[k][1], c(1))))
                if l2_ahead:   # the step whose slot frees l2_ahead steps from now: its rows into L2 now
                    prefetch_step(arith.addi(g, c(stages + l2_ahead)))
                if not (pdq or direct):   # (pdq: this warpgroup converted the slot's last step itself, a barrier
                    # ago; direct waits for its tile in direct_step, after the first loads)
                    region = begin("p_wait_empty")
                    with mu.when(arith.cmpi(arith.CmpIPredicate.uge, g, c(stages))):
                        (st_empty if conv else empty_bars)[slot].wait()
                    end(region)
                region = begin("p_issue")
                full = None if direct else st_bars[slot] if tiles else full_bars[slot]
                off = arith.muli(arith.subi(j, ranges[k][2]), c(bk))
                if idx_ring:
                    # the step's entries, cleaned as `entry` does, into ring slot u: the consumers that read the
                    # slot's previous step (g - idx_ring) are past it, as idx_ring exceeds the producer's lead. The
                    # warpgroup barrier puts every thread's store before the copies' issue (lane 0 of each warp
                    # reads the slot) and before the full barrier's arrival (its release publishes them)
                    u = arith.remui(g, c(idx_ring))
                    ok = names_row(k, carry, arith.addi(arith.muli(j, c(bk)), ptid))
                    with mu.when(arith.cmpi(arith.CmpIPredicate.ult, ptid, c(bk))):
                        memref.store(arith.select(ok, carry, ci(-1)), idx_smem,
                                     [arith.addi(arith.muli(u, c(bk)), ptid)])
                    mu.warpgroup_barrier()
                    carry = nxt
                    src_row = lambda r: ring_row(u, r)
                else:
                    src_row = lambda r: row_of(k, arith.addi(off, r))
                if direct:
                    end(region)
                    if direct_prefetch:
                        direct_prefetch_next(k, j, nxt if idx_ring else None)
                    (direct_tile_step if direct_tile else direct_step)(k, g, src_row)
                    return carry
                if cp_async:
                    issue_cp_async(k, slot, full, off)
                    end(region)
                    return carry
                piece_bar = None
                if piece_bars:   # each piece of d on its own barrier (slot-major)
                    piece_bar = lambda p_: full_bars[arith.addi(arith.muli(slot, c(pieces)),
                                                                c(p_) if isinstance(p_, int) else p_)]
                    for p_ in range(pieces):
                        piece_bar(p_).arrive_expect_tx(bk * tc * 2, predicate=one)
                else:
                    full.arrive_expect_tx(bk * (NOPE_DIM + 2 * ROPE_DIM if fp8 else d * 2), predicate=one)
                if piece_bars == "pieces":   # all rows' piece p, then the next; each row's index read once
                    rows_ = [arith.addi(c(4 * t), warp) for t in range(bk // 4)]
                    es = [src_row(r) for r in rows_]
                    half = pieces // 2

                    @mu.fori(c(pieces), None)
                    def _(i, _c):   # pieces 0, P/2, 1, P/2 + 1, ...: consumer w reads [w P/2, (w + 1) P/2),
                        # so both consumers' score chains start after the block's first two pieces land
                        p_ = arith.addi(arith.muli(arith.remui(i, c(2)), c(half)), arith.divui(i, c(2)))
                        for r, e in zip(rows_, es):
                            copy_piece(k, slot, piece_bar(p_), r, e, p_)
                        return _c
                else:   # rows in order, each row's pieces together (piece_bars "rows": each on its own barrier)
                    # fp8_copy "bulk": the warp's first row as an opaque function of the step, or ptxas hoists the
                    # unrolled rows' shared-memory offsets out of the step loop and spills them (80 B at the
                    # producer's 40 registers, offline, session 71)
                    warp_ = opaque_in_step(warp, g) if fp8 and fp8_copy == "bulk" else warp

                    @mu.fori(c(bk // 4), None)
                    def _(t, _c):
                        r = arith.addi(arith.muli(t, c(4)), warp_)
                        copy_row(k, slot, full, r, src_row(r), piece_bar)
                        return _c

                if fp8:
                    with mu.when(lane0):   # one of the slot's 4 counted arrivals, once this thread's scale copies land
                        nvvm.cp_async_mbarrier_arrive(full.get_ptr(), noinc=True)
                end(region)
                if p_units:   # the step staged (stages - 1) steps ago (pdq: all of it; conv: its units
                    # past conv_units), into the tile ring, while this one's copies fly. Its staging slot is the one
                    # the next issue overwrites: the warpgroup barrier orders our reads before that issue.
                    with mu.when(arith.cmpi(arith.CmpIPredicate.uge, g, c(stages - 1))):
                        convert_step(arith.subi(g, c(stages - 1)), "p", lambda _s: mu.warpgroup_barrier(), p_units)
                return carry

            if idx_ring:   # each source's first step: its entry loaded here, the rest a step ahead in produce
                first_entry = lambda k, _c: raw_entry(k, arith.minsi(ranges[k][0], c(srcs[k]["k"] // bk - 1))) \
                    if srcs[k]["k"] else ci(0)
                steps(produce, ci(0), first_entry)
            else:
                steps(produce, None)
            if p_units:   # the last (stages - 1) staged steps
                total = total_steps()
                n_tail = arith.minsi(total, c(stages - 1))

                @mu.fori(n_tail, None)
                def _(i, _c):
                    convert_step(arith.addi(arith.subi(total, n_tail), i), "p", lambda _s: mu.warpgroup_barrier(),
                                 p_units)
                    return _c
            if ccomb:   # the producer takes part in the consumers' two cluster barriers (see cluster_combine)
                for _ in range(2):
                    cluster_sync()
            scf.yield_([])

        with ir.InsertionPoint(if_op.else_block), contextlib.ExitStack() as cons_scope:
            if conv:   # ---------------- converter (wg 3) ----------------
                conv_if = scf.IfOp(arith.cmpi(arith.CmpIPredicate.eq, wg, ci(3)), has_else=True)
                with ir.InsertionPoint(conv_if.then_block):
                    nvvm.setmaxregister(regs[1], nvvm.SetMaxRegisterAction.decrease)

                    @mu.fori(total_steps(), None)
                    def _(gs, _c):
                        convert_step(gs, "v", lambda s_: st_empty[s_].arrive(), (0, conv_units))
                        return _c

                    if ccomb:   # the converter takes part in the consumers' two cluster barriers too
                        for _ in range(2):
                            cluster_sync()
                    scf.yield_([])
                cons_scope.enter_context(ir.InsertionPoint(conv_if.else_block))
            # ---------------- consumers (wg 0, 1) ----------------
            if not uneven:   # (uneven: each consumer raises its own count where its branch starts, finish_role's
                # callers: ptxas takes the lowest count that reaches a block, so a raise ahead of the branch would
                # hold the helper to the scorer's)
                nvvm.setmaxregister(regs[-1], nvvm.SetMaxRegisterAction.increase)
            wgi = arith.index_cast(index, wg)

            def consumers_barrier():   # named barrier 8 (Mosaic uses 0 and 1-4), the 256 consumer threads
                llvm.inline_asm(ir.Type.parse("!llvm.void"), [], "bar.sync 8, 256;", "", has_side_effects=True)

            region = begin("c_wait_q")
            q_bar.wait()
            # the producer has cleaned this split's index rows (named barrier 9: 128 producer arrivals + us)
            llvm.inline_asm(ir.Type.parse("!llvm.void"), [], "bar.sync 9, 384;", "", has_side_effects=True)
            end(region)
            if f16:   # q's tile, bf16 bits as landed, to f16 in place before the first scores (both consumers)
                region = begin("c_q_f16")
                if diag != "no_q_convert":   # (the timing bound: q's bits read as f16, wrong output)
                    n_q = BLOCK_H * d // 8                                     # 16 B chunks of the q tile
                    flat_q = mu.memref_reshape(q_smem, (n_q, 8))
                    tid = arith.index_cast(index, mu.thread_idx())             # 0..255: the consumers
                    v8 = ir.VectorType.get((8,), f16_ty)
                    for b0 in range(0, n_q // 256, Q_F16_BATCH):               # a batch's loads before its stores
                        at = [[arith.addi(tid, c(256 * i)), c(0)] for i in range(b0, b0 + Q_F16_BATCH)]
                        vals = [vector.bitcast(ir.VectorType.get((8,), bf16), vector.load(v8, flat_q, ix))
                                for ix in at]
                        for ix, v in zip(at, vals):
                            vector.store(to_f16(v), flat_q, ix, alignment=16)
                    nvvm.fence_proxy(nvvm.ProxyKind.async_shared, space=nvvm.SharedSpace.shared_cta)  # -> wgmma
                consumers_barrier()
                end(region)
            sink_raw = fa.FragmentedArray.load_untiled(mu.memref_slice(vec_smem, mu.ds(0, BLOCK_H)),
                                                       layout=fa.WGMMA_ROW_LAYOUT, optimized=False)
            sink2 = sink_raw * LOG2E
            zero_row = fa.FragmentedArray.splat(arith.constant(f32, 0.0), (BLOCK_H,), fa.WGMMA_ROW_LAYOUT)
            # conv: the [64, dh] accumulator as two [64, dh / 2] halves, each its own m64n128 wgmma. ptxas checks every
            # instruction against the launch's register count before it applies setmaxnreg's regions: 128 a thread
            # at 512 threads, and one m64n256 wgmma with an f32 accumulator needs 158 (session 23).
            pv_parts = 2 if conv else 1
            acc0 = tuple(fa.FragmentedArray.splat(arith.constant(f32, 0.0), (BLOCK_H, dh // pv_parts), fa.WGMMA_LAYOUT)
                         for _ in range(pv_parts))
            half = bk // 2
            n_scored = half if split_scores else bk   # entries whose scores this consumer computes per block
            neg_inf = fa.FragmentedArray.splat(arith.constant(f32, -math.inf), (BLOCK_H, n_scored), fa.WGMMA_LAYOUT)
            v_cols = mu.ds(arith.muli(wgi, c(pieces // 2)), pieces // 2)
            pv_cols = [mu.ds(arith.addi(arith.muli(wgi, c(pieces // 2)), c(h * pieces // 2 // pv_parts)),
                             pieces // 2 // pv_parts) for h in range(pv_parts)]   # v_cols in pv_parts pieces
            # uneven: the scorer's P.V columns [0, scorer_cols), the helper's the rest, 128 columns a piece
            part_pieces = 128 // tc
            role_cols = [[mu.ds(c(i), part_pieces) for i in range(lo, hi, part_pieces)]
                         for lo, hi in ((0, scorer_cols // tc), (scorer_cols // tc, pieces))] if uneven else None
            role_acc0 = [tuple(fa.FragmentedArray.splat(arith.constant(f32, 0.0), (BLOCK_H, 128), fa.WGMMA_LAYOUT)
                               for _ in cols_) for cols_ in role_cols] if uneven else None

            # pingpong: the consumers take turns at the tensor cores, S(wg 0), S(wg 1), P.V(wg 0), P.V(wg 1), ...,
            # so one's softmax runs under the other's wgmma instead of both computing S at once and both idling the
            # tensor cores during the softmax. Named barrier 10 + w is consumer w's turn: the other consumer passes
            # it (bar.arrive, 128 threads) right after issuing its wgmma, w waits for it (bar.sync, 128 threads)
            # before issuing. Strict alternation never lets two passes pile up on one barrier; consumer 1 passes
            # the first turn to consumer 0 before its first step, and consumer 0 takes the one pass left over
            # after its last step, so every barrier ends balanced whatever the step count (0 included).
            my_turn_bar = arith.addi(ci(10), wg)
            other_turn_bar = arith.subi(ci(11), wg)

            def turn(op, bar):
                if pingpong:
                    llvm.inline_asm(ir.Type.parse("!llvm.void"), [bar], f"{op} $0, 256;", "r",
                                    has_side_effects=True)

            def cluster_combine():
                """The split-K merge inside the kernel (combine="cluster"). The row's ns split CTAs are one cluster
                (cluster dims (1, ns, 1): rank = split). Each holds its partial o (normalised by its own l, bf16) in
                its q tile and its lse row in vec_smem[64:128] (written just before). After a cluster barrier, CTA s
                merges the output rows of the 8-head units u with u % ns == s: it reads the ns partials' 16 B chunks
                of those rows from the peers' shared memory (mapa + ld.shared::cluster), weighs them in f32 with
                w_p = exp(lse_p - m) / (sum_p exp(lse_p - m) + exp(sink - m)), m = max(sink, lse_p) (the merge of
                `common.combine_splits`), writes the bf16 sums over the same rows of its own tile (each unit has one
                owner, and a peer reads from us only the units it owns, so no read races a write), and stores
                each unit with one bulk copy; one thread per head stores the merged lse (without the sink).
                A second cluster barrier keeps every CTA's shared memory alive until its peers have read it. The
                partials never touch HBM and no second kernel runs."""
                region = begin("c_cl_sync1")
                cluster_sync()   # every split's partial tile and lse row are written (release / acquire)
                end(region)
                tid = mu.thread_idx()                                 # i32, 0..255 (the consumer warpgroups)
                q_base = llvm.ptrtoint(i32, mu.memref_ptr(q_smem))     # shared::cta addresses (32-bit)
                v_base = llvm.ptrtoint(i32, mu.memref_ptr(vec_smem))
                rank = arith.index_cast(i32, split)
                cpr = swz // 16                    # 16 B chunks per tile row (one head's row of one tile)
                unit_bytes = 8 * d * 2             # 8 heads x d bf16: the q tile's first axis
                n_chunks = unit_bytes // 16
                head_in_unit = arith.divui(arith.remui(tid, ci(8 * cpr)), ci(cpr))   # the same for tid + 256 i
                v4_ty = ir.Type.parse("!llvm.struct<(i32, i32, i32, i32)>")
                f32c = lambda v: arith.constant(f32, v)

                def ld_f32(addr, p):   # f32 at shared::cta address `addr` of cluster CTA p
                    return llvm.inline_asm(f32, [addr, p], "{ .reg .b32 a; mapa.shared::cluster.u32 a, $1, $2; "
                                           "ld.shared::cluster.f32 $0, [a]; }", "=f,r,r", has_side_effects=True)

                def ld_v4(addr, p):   # 16 B at shared::cta address `addr` of cluster CTA p
                    r = llvm.inline_asm(v4_ty, [addr, p], "{ .reg .b32 a; mapa.shared::cluster.u32 a, $4, $5; "
                                        "ld.shared::cluster.v4.b32 {$0, $1, $2, $3}, [a]; }", "=r,=r,=r,=r,r,r",
                                        has_side_effects=True)
                    return [llvm.extractvalue(i32, r, [k]) for k in range(4)]

                def ex2(x):
                    return llvm.inline_asm(f32, [x], "ex2.approx.ftz.f32 $0, $1;", "=f,f")

                def pack(hi, lo):
                    return llvm.inline_asm(i32, [hi, lo], "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f")

                n_units = BLOCK_H // 8
                n_it = -(-n_chunks // 256)         # 16 B chunks per thread and unit

                def unit_loads(u):
                    """Unit u's (i32) remote reads for this thread: the ns lse values of its head, then the ns
                    partials' chunks tid + 256 i (a tail chunk past the unit reads chunk 0; its result is dropped)."""
                    head = arith.addi(arith.muli(u, ci(8)), head_in_unit)
                    lse_p = [ld_f32(arith.addi(v_base, arith.muli(arith.addi(head, ci(BLOCK_H)), ci(4))), ci(p))
                             for p in range(ns)]
                    chunks = []
                    for i in range(n_it):
                        cidx = arith.addi(tid, ci(256 * i))
                        ok = arith.cmpi(arith.CmpIPredicate.ult, cidx, ci(n_chunks))
                        addr = arith.addi(q_base, arith.addi(arith.muli(u, ci(unit_bytes)),
                                                             arith.muli(arith.select(ok, cidx, ci(0)), ci(16))))
                        chunks.append((ok, addr, [ld_v4(addr, ci(p)) for p in range(ns)]))
                    return head, lse_p, chunks

                def unit_merge(head, lse_p, chunks):
                    """The merged rows of one unit from its loaded partials: bf16 over our own tile, lse to HBM."""
                    sink = memref.load(vec_smem, [arith.index_cast(index, head)])     # natural log units
                    m_ = sink
                    for x in lse_p:
                        m_ = arith.maximumf(m_, x)                                   # finite: the sink is
                    e_p = [ex2(arith.mulf(arith.subf(x, m_), f32c(LOG2E))) for x in lse_p]   # 0 if empty
                    se = e_p[0]
                    for x in e_p[1:]:
                        se = arith.addf(se, x)
                    inv = arith.divf(f32c(1.0), arith.addf(se, ex2(arith.mulf(arith.subf(sink, m_), f32c(LOG2E)))))
                    w = [arith.mulf(x, inv) for x in e_p]
                    for i, (ok, addr, parts) in enumerate(chunks):
                        acc = [f32c(0.0)] * 8
                        for p, words4 in enumerate(parts):
                            for k, wd in enumerate(words4):
                                lo = arith.bitcast(f32, arith.shli(wd, ci(16)))
                                hi = arith.bitcast(f32, arith.andi(wd, ci(-65536)))
                                acc[2 * k] = arith.addf(acc[2 * k], arith.mulf(w[p], lo))
                                acc[2 * k + 1] = arith.addf(acc[2 * k + 1], arith.mulf(w[p], hi))
                        words = [pack(acc[2 * k + 1], acc[2 * k]) for k in range(4)]
                        with mu.when(ok) if 256 * (i + 1) > n_chunks else contextlib.nullcontext():
                            llvm.inline_asm(ir.Type.parse("!llvm.void"), [addr, *words],
                                            "st.shared.v4.b32 [$0], {$1, $2, $3, $4};", "r,r,r,r,r",
                                            has_side_effects=True)
                    lse_o = arith.select(arith.cmpf(arith.CmpFPredicate.OGT, se, f32c(0.0)),
                                         arith.addf(m_, arith.mulf(llvm.inline_asm(
                                             f32, [se], "lg2.approx.ftz.f32 $0, $1;", "=f,f"), f32c(LN2))),
                                         f32c(-math.inf))
                    first = arith.andi(arith.cmpi(arith.CmpIPredicate.ult, tid, ci(8 * cpr)),
                                       arith.cmpi(arith.CmpIPredicate.eq, arith.remui(tid, ci(cpr)), ci(0)))
                    with mu.when(first):   # one thread per head of the unit, straight to global memory (a
                        # bulk copy of 8 lse values would need a 128 B aligned shared-memory source)
                        memref.store(lse_o, lse_gmem, [row, hg, arith.index_cast(index, head)])

                owned = [arith.cmpi(arith.CmpIPredicate.eq, rank, ci(u % ns)) for u in range(n_units)]
                region = begin("c_merge")
                if cluster_early:
                    # CTA `rank` owns units rank, rank + ns, ...: every remote read of all of them is issued before
                    # any merge math, so their DSMEM latencies overlap (per unit, behind a branch each, they queue
                    # one after another). A unit index past the last (ns not dividing 8) reads our first unit again
                    # and merges nothing.
                    loaded = []
                    for k in range(-(-n_units // ns)):
                        u = arith.addi(ci(k * ns), rank)
                        valid = None
                        if (k + 1) * ns > n_units:
                            valid = arith.cmpi(arith.CmpIPredicate.ult, u, ci(n_units))
                            u = arith.select(valid, u, rank)
                        loaded.append((valid, unit_loads(u)))
                    for valid, ld in loaded:
                        with mu.when(valid) if valid is not None else contextlib.nullcontext():
                            unit_merge(*ld)
                else:   # per unit: its reads, then its merge, one unit after another
                    for u in range(n_units):
                        with mu.when(owned[u]):
                            unit_merge(*unit_loads(ci(u)))
                end(region)
                mu.commit_shared()    # our generic-proxy stores, before the bulk copies read them
                consumers_barrier()
                with mu.when(arith.cmpi(arith.CmpIPredicate.eq, wg, ci(0))):
                    for u in range(BLOCK_H // 8):
                        mine = arith.andi(one, owned[u])
                        ctx.async_copy(src_ref=mu.memref_slice(q_smem, mu.ds(u, 1)), dst_ref=o_gmem,
                                       gmem_slice=(row, hg, mu.ds(8 * u, 8)), gmem_transform=mgpu.TileTransform((8, tc)),
                                       swizzle=swz, predicate=mine)
                region = begin("c_cl_sync2")
                cluster_sync()   # the peers are done reading our tile: it may go away
                end(region)
                with mu.when(arith.cmpi(arith.CmpIPredicate.eq, wg, ci(0))):
                    ctx.await_async_copy(0, await_read_only=store_wait_read)

            def dequantize(slot):
                """Staging slot -> the bf16 KV tile, in the 128 B-swizzled (8, 64) tiling wgmma reads.
                Both consumers together (without split_d, or _diag="dequant_both"): thread t of the 256 consumer
                threads converts the 16-byte nope chunks v = t + 256 i (row v // 28, chunk v % 28, scale block chunk
                // 4) and copies the 16-byte rope chunks t + 256 i; the tile is free once both consumers are past the
                previous block's P.V (named barrier 8 before), complete after the second barrier.
                Each consumer its own half (split_d, the default there): a consumer reads only its half of d's
                columns (its half of S, and P.V for its own output columns), so it converts only that half: consumer
                0 the nope blocks 0-3, consumer 1 the blocks 4-6 and the rope part, with its own warpgroup's barriers
                instead of the 256-thread ones: the two meet only at the score exchange."""
                tid = arith.index_cast(index, mu.thread_idx())
                own_half = split_d and diag != "dequant_both"
                sync = mu.warpgroup_barrier if own_half else consumers_barrier
                sync()
                ncb_all = NOPE_DIM // 16    # 28 nope chunks per row
                if diag == "no_dequant":   # timing diagnostic only (wrong values): the barriers, no data movement
                    pass
                elif own_half:
                    lt = arith.remui(tid, c(128))
                    ncb0 = ncb_all * 4 // 7                       # 16 chunks: nope blocks 0-3 = columns [0, d/2)
                    for w, (ncb, cb0, n_rope) in enumerate(((ncb0, 0, 0), (ncb_all - ncb0, ncb0, bk * 8 // 128))):
                        with mu.when(arith.cmpi(arith.CmpIPredicate.eq, wg, ci(w))):
                            for i in range(bk * ncb // 128):
                                convert_chunk(slot, arith.addi(lt, c(128 * i)), ncb, cb0)
                            for i in range(n_rope):
                                copy_rope(slot, arith.addi(lt, c(128 * i)))
                else:
                    if diag == "loop":   # the same conversion as a loop (fewer live registers than the unrolled default)
                        @mu.fori(c(bk * ncb_all // 256), None)
                        def _(i, _c):
                            convert_chunk(slot, arith.addi(tid, arith.muli(i, c(256))), ncb_all, 0)
                            return _c
                    else:
                        for i in range(bk * ncb_all // 256):
                            convert_chunk(slot, arith.addi(tid, c(256 * i)), ncb_all, 0)
                    for i in range(bk * 8 // 256):
                        copy_rope(slot, arith.addi(tid, c(256 * i)))
                nvvm.fence_proxy(nvvm.ProxyKind.async_shared, space=nvvm.SharedSpace.shared_cta)  # st.shared -> wgmma
                sync()

            def dequantize_scoring(slot):
                """fp8_overlap (FP8 + split_d): this consumer's half of the block converted one 64-column piece at a
                time, each piece's score wgmma (q[:, piece] K[:, piece]^T, 4 k-steps) issued as soon as the piece is
                in the tile and left running while the next piece converts, so the conversions overlap the tensor
                cores instead of preceding them. Consumer w owns pieces 4w .. 4w + 3 (consumer 1's last is the rope
                part, copied). One warpgroup barrier per piece publishes its stores to the wgmma (after the async
                proxy fence); the first one keeps the tile until this consumer's previous P.V is done with it.
                Returns this consumer's partial S [64, bk] f32, the staging slot released."""
                lt = arith.remui(arith.index_cast(index, mu.thread_idx()), c(128))
                mu.warpgroup_barrier()
                s_acc = mgpu.WGMMAAccumulator.zero(BLOCK_H, bk)
                for p in range(4):
                    piece = arith.addi(arith.muli(wgi, c(4)), c(p))
                    if p < 3:   # nope block `piece`: 64 rows x 4 chunks of 16 e4m3, two per thread
                        for i in range(bk * 4 // 128):
                            convert_chunk(slot, arith.addi(lt, c(128 * i)), 4, arith.muli(piece, c(4)))
                    else:       # consumer 0: nope block 3; consumer 1: the rope part (64 rows x 8 chunks of 8 bf16)
                        with mu.when(arith.cmpi(arith.CmpIPredicate.eq, wg, ci(0))):
                            for i in range(bk * 4 // 128):
                                convert_chunk(slot, arith.addi(lt, c(128 * i)), 4, 12)
                        with mu.when(arith.cmpi(arith.CmpIPredicate.eq, wg, ci(1))):
                            for i in range(bk * 8 // 128):
                                copy_rope(slot, arith.addi(lt, c(128 * i)))
                    nvvm.fence_proxy(nvvm.ProxyKind.async_shared, space=nvvm.SharedSpace.shared_cta)
                    mu.warpgroup_barrier()
                    cols = (slice(None), mu.ds(piece, 1))
                    s_acc = mgpu.wgmma(s_acc, mu.memref_slice(q_smem, cols),
                                       mu.memref_transpose(mu.memref_slice(tile, cols), (1, 0, 3, 2)), swizzle=swz)
                    nvvm.wgmma_commit_group_sync_aligned()
                empty_bars[slot].arrive()                               # the staging slot can be refilled
                nvvm.wgmma_wait_group_sync_aligned(0)
                return s_acc.value

            def split_softmax(valid, kv, g, m, l):
                """split_scores: this consumer computes the scores of its half of the block's entries only (half the
                tensor work of both computing all of them), then the two exchange their bf16 P halves and row maxima
                through shared memory (one named barrier per block; buffers alternate with the step's parity, so a
                fast consumer never overwrites what the other has yet to read: it must first pass the next step's
                barrier, which the other reaches only after reading). Running maxima are integers (log2 units), so
                rescaling the other half's P by 2^(m_half - m_new) is exact. l is this consumer's partial sum (its own
                entries), combined once at the end. valid [64, bk/2]: this consumer's entries. Returns
                (m_new, l, P [64, bk] bf16)."""
                rows = mu.memref_slice(kv, mu.ds(arith.muli(wgi, c(half // 8)), half // 8))   # [half/8, d/64, 8, 64]
                s_acc = mgpu.WGMMAAccumulator.zero(BLOCK_H, half)
                s_acc = mgpu.wgmma(s_acc, q_smem, mu.memref_transpose(rows, (1, 0, 3, 2)), swizzle=swz)
                nvvm.wgmma_commit_group_sync_aligned()
                nvvm.wgmma_wait_group_sync_aligned(0)
                logits = valid.select(s_acc.value * scale2, neg_inf)
                m_own = m.max(logits.reduce("max", axis=1).round())     # integer, >= m (an integer too)
                p_own = (logits - m_own.broadcast_minor(half)).exp2(approx=True)
                par = arith.remui(g, c(2))
                if diag != "ss_noexchange":
                    p_own.astype(bf16).store_untiled(mu.memref_slice(x_p, (par, wgi)), optimized=False)
                m_own.store_untiled(mu.memref_slice(x_m, (par, wgi)), optimized=False)
                consumers_barrier()
                m_h = [fa.FragmentedArray.load_untiled(mu.memref_slice(x_m, (par, c(i))), layout=fa.WGMMA_ROW_LAYOUT,
                                                       optimized=False) for i in range(2)]
                m_new = m_h[0].max(m_h[1])
                l = l * (m - m_new).exp2(approx=True) + \
                    p_own.reduce("add", axis=1) * (m_own - m_new).exp2(approx=True)
                p = fa.FragmentedArray.splat(arith.constant(bf16, 0.0), (BLOCK_H, bk), fa.WGMMA_LAYOUT)
                for i in range(2):
                    if diag == "ss_noexchange":   # diagnostic (wrong output): own half only, no P through smem
                        p_h = p_own
                    else:
                        p_h = fa.FragmentedArray.load_untiled(mu.memref_slice(x_p, (par, c(i))),
                                                              layout=fa.WGMMA_LAYOUT, optimized=False).astype(f32)
                    p[:, i * half:(i + 1) * half] = \
                        (p_h * (m_h[i] - m_new).exp2(approx=True).broadcast_minor(half)).astype(bf16)
                return m_new, l, p

            def split_d_scores(kv, own=None, slot=None):
                """split_d: S = q K^T over this consumer's half of d (16 k-steps of m64n<bk>k16 instead of 32), its
                f32 partial through shared memory to the other consumer, which adds it to its own
                (`exchange_partials`): each computes half the score work instead of all of it, and both hold the same
                S. own: this consumer's partial, already computed (fp8_overlap). piece_bars: each of this consumer's
                pieces of d waited for (slot's piece barriers) right before its 4 k-steps are issued. Returns S [64, bk]
                f32 (WGMMA layout)."""
                if own is None and piece_bars:
                    s_acc = mgpu.WGMMAAccumulator.zero(BLOCK_H, bk)
                    for p_ in range(pieces // 2):
                        piece = arith.addi(arith.muli(wgi, c(pieces // 2)), c(p_))
                        full_bars[arith.addi(arith.muli(slot, c(pieces)), piece)].wait()
                        cols = (slice(None), mu.ds(piece, 1))
                        s_acc = mgpu.wgmma(s_acc, mu.memref_slice(q_smem, cols),
                                           mu.memref_transpose(mu.memref_slice(kv, cols), (1, 0, 3, 2)), swizzle=swz)
                        nvvm.wgmma_commit_group_sync_aligned()
                    nvvm.wgmma_wait_group_sync_aligned(0)
                    own = s_acc.value
                if own is None:
                    s_acc = issue_own_scores(kv)
                    nvvm.wgmma_wait_group_sync_aligned(0)
                    own = s_acc.value
                return exchange_partials(own)

            def issue_own_scores(kv):
                """split_d: q K^T over this consumer's half of d for the block in kv [bk/8, d/tc, 8, tc], committed
                as one wgmma group and not waited for. -> the [64, bk] f32 accumulator in flight."""
                s_acc = mgpu.WGMMAAccumulator.zero(BLOCK_H, bk)
                k_half = mu.memref_transpose(mu.memref_slice(kv, (slice(None), v_cols)), (1, 0, 3, 2))
                s_acc = mgpu.wgmma(s_acc, mu.memref_slice(q_smem, (slice(None), v_cols)), k_half, swizzle=swz)
                nvvm.wgmma_commit_group_sync_aligned()
                return s_acc

            def exchange_partials(own):
                """split_d: our f32 partial scores [64, bk] through shared memory to the other consumer, theirs to
                us -> S = own + other (bit-identical in both: a + b == b + a in f32). The first barrier keeps us from
                overwriting the buffer the other may still be reading (last step's partial, or the sinks aliased into
                it before the first step); the second publishes our partial."""
                consumers_barrier()
                own.store_tiled(mu.memref_slice(x_s, wgi), swizzle=128)
                consumers_barrier()
                other = fa.FragmentedArray.load_tiled(mu.memref_slice(x_s, arith.subi(c(1), wgi)), swizzle=128,
                                                      layout=fa.WGMMA_LAYOUT)
                return own + other

            def warp_any(flag):
                """i1: whether `flag` (an i1 FragmentedArray) is true in any register of any lane of this warp."""
                bits = [vector.extract(r, [], [e]) for r in flag.registers.flat
                        for e in range(ir.VectorType(r.type).shape[0])]
                own = bits[0]
                for bit in bits[1:]:
                    own = arith.ori(own, bit)
                anyw = llvm.inline_asm(i32, [arith.extui(i32, own)],
                                       "{ .reg .pred p, q; setp.ne.u32 p, $1, 0; "
                                       "vote.sync.any.pred q, p, 0xffffffff; selp.u32 $0, 1, 0, q; }", "=r,r")
                return arith.cmpi(arith.CmpIPredicate.ne, anyw, ci(0))

            def two_way(cond, then_fn, else_fn, like):
                """scf.if over FragmentedArrays: then_fn() where cond, else else_fn(); both return arrays of the
                shapes and layouts of `like`, and so does this."""
                flat = [r for a in like for r in a.registers.flat]
                if_op = scf.IfOp(cond, [r.type for r in flat], has_else=True)
                with ir.InsertionPoint(if_op.then_block):
                    scf.yield_([r for a in then_fn() for r in a.registers.flat])
                with ir.InsertionPoint(if_op.else_block):
                    scf.yield_([r for a in else_fn() for r in a.registers.flat])
                res, out = iter(if_op.results), []
                for a in like:
                    regs = np.empty(a.registers.shape, dtype=object)
                    regs.flat[:] = [next(res) for _ in range(regs.size)]
                    out.append(fa.FragmentedArray(_registers=regs, _layout=a.layout, _is_signed=a.is_signed))
                return tuple(out)

            def when_else(cond, then_fn, arrays):
                """scf.if over FragmentedArrays: then_fn() (same layouts as `arrays`) where cond, else `arrays`
                unchanged. cond is warp-uniform (warp_any), so a warp either runs then_fn's instructions or skips
                them."""
                return two_way(cond, then_fn, lambda: arrays, arrays)

            def online_softmax(scores, valid, m, l):
                """One block's step of the online softmax in exp2 units. scores [64, bk] f32 (q.K, unscaled), valid
                [64, bk] (entry names a row), m / l [64] the running max and sum. Lazy: m moves only where the
                block's max passes it by LAZY_RESCALE_LOG2 (so p <= 2^that). -> (m_new, alpha = 2^(m - m_new),
                l_new, P [64, bk] bf16, f16 with f16)."""
                logits = valid.select(scores * scale2, neg_inf)
                if lazy:
                    blk_max = logits.reduce("max", axis=1)
                    m_new = (blk_max > m + LAZY_RESCALE_LOG2).select(blk_max, m)
                else:
                    m_new = m.max(logits.reduce("max", axis=1))
                alpha = (m - m_new).exp2(approx=True)
                p = (logits - m_new.broadcast_minor(bk)).exp2(approx=True)
                return m_new, alpha, l * alpha + p.reduce("add", axis=1), p.astype(op_ty)

            def rescaled_accumulators(acc, alpha, m, m_new):
                """The output accumulators (pv_parts of [64, dh / pv_parts] f32) times alpha, as wgmma
                accumulators. Lazy (never with split_scores: the wrapper turns it off there): a warp rescales its
                16 rows' registers only if one of them raised its m."""
                if lazy:
                    moved = warp_any(m_new > m)
                    acc = when_else(moved, lambda: [a * alpha.broadcast_minor(dh // pv_parts) for a in acc], acc)
                    return [mgpu.WGMMAAccumulator.from_registers(a) for a in acc]
                return [mgpu.WGMMAAccumulator.from_registers(a * alpha.broadcast_minor(dh // pv_parts)) for a in acc]

            def issue_pv(o_accs, p, kv, cols_=None):
                """o += P.V over this consumer's output columns of kv [bk/8, d/tc, 8, tc] (V = K; cols_: pv_cols),
                committed as one wgmma group and not waited for. -> the accumulators in flight."""
                o_accs = [mgpu.wgmma(o_acc, p, mu.memref_slice(kv, (slice(None), cols)), swizzle=swz)
                          for o_acc, cols in zip(o_accs, cols_ or pv_cols)]
                nvvm.wgmma_commit_group_sync_aligned()
                return o_accs

            def first_entry(k, j, g):
                """Step g's (source k, block j) first entry in idx_smem that this consumer scores: all the block's,
                or its half with split_scores. idx_ring: ring slot g % idx_ring, written by the producer before the
                step's full barrier (read after it)."""
                off = arith.muli(arith.subi(j, ranges[k][2]), c(bk))
                first = arith.muli(arith.remui(g, c(idx_ring)), c(bk)) if idx_ring else arith.addi(c(idx_base[k]), off)
                if split_scores:
                    first = arith.addi(first, arith.muli(wgi, c(half)))
                return first

            def valid_from(first):
                """[64, n_scored] bool: entries first .. first + n_scored of idx_smem name a row (>= 0)."""
                ids = fa.FragmentedArray.load_untiled(mu.memref_slice(idx_smem, mu.ds(first, n_scored)),
                                                      layout=fa.WGMMA_COL_LAYOUT, is_signed=True, optimized=False)
                return (ids >= 0).broadcast_in_dim((BLOCK_H, n_scored), (1,), fa.WGMMA_LAYOUT)

            def wait_full(slot):
                """Wait for ring slot `slot`'s block (None: no wait, piece_bars waits piece by piece); the
                cp.async copies (direct_tile: its rope rows) went through the generic proxy, which the wgmma's
                async-proxy reads must be fenced against."""
                if slot is not None:
                    full_bars[slot].wait()
                if cp_async or direct_tile:
                    llvm.inline_asm(ir.Type.parse("!llvm.void"), [], "fence.proxy.async.shared::cta;", "",
                                    has_side_effects=True)


            def consume(k, j, g, carry):
                m, l, acc = carry
                slot = arith.remui(g, c(n_ring))
                first = first_entry(k, j, g)
                load_valid = lambda: valid_from(first)
                if not idx_ring:
                    valid = load_valid()
                region = begin("c_wait_full")
                wait_full(None if piece_bars else slot)   # (piece_bars: each piece is waited for in split_d_scores)
                end(region)
                if idx_ring and not piece_bars:
                    valid = load_valid()
                own = None
                if fp8 and fp8_overlap:
                    region = begin("c_dequant_scores")   # conversions and this consumer's score wgmma, overlapped
                    own = dequantize_scoring(slot)
                    end(region)
                    kv = tile
                elif fp8 and not tiles:
                    region = begin("c_dequant")
                    dequantize(slot)
                    empty_bars[slot].arrive()                           # the staging slot can be refilled
                    end(region)
                    kv = tile
                else:   # bf16 ring, or pdq's tile ring
                    kv = mu.memref_slice(ring, slot)                    # [bk/8, d/tc, 8, tc]
                if split_scores:
                    region = begin("c_split_softmax")   # half the scores, the exchange, the softmax
                    m_new, l, p = split_softmax(valid, kv, g, m, l)
                    alpha = (m - m_new).exp2(approx=True)
                    end(region)
                else:
                    region = begin("c_scores")
                    if split_d:
                        scores = split_d_scores(kv, own, slot)
                        if idx_ring and piece_bars:   # the ring slot is published by every piece's barrier
                            valid = load_valid()
                    else:
                        turn("bar.sync", my_turn_bar)
                        s_acc = mgpu.WGMMAAccumulator.zero(BLOCK_H, bk)
                        s_acc = mgpu.wgmma(s_acc, q_smem, mu.memref_transpose(kv, (1, 0, 3, 2)), swizzle=swz)
                        nvvm.wgmma_commit_group_sync_aligned()
                        turn("bar.arrive", other_turn_bar)
                        nvvm.wgmma_wait_group_sync_aligned(0)
                        scores = s_acc.value
                    end(region)
                    region = begin("c_softmax")
                    m_new, alpha, l, p = online_softmax(scores, valid, m, l)
                    end(region)
                region = begin("c_pv")
                o_accs = rescaled_accumulators(acc, alpha, m, m_new)
                turn("bar.sync", my_turn_bar)
                o_accs = issue_pv(o_accs, p, kv)
                turn("bar.arrive", other_turn_bar)
                nvvm.wgmma_wait_group_sync_aligned(0)
                if not fp8 or tiles:
                    empty_bars[slot].arrive()
                end(region)
                return m_new, l, tuple(o_acc.value for o_acc in o_accs)

            m0 = sink2.round() if split_scores else sink2   # split_scores keeps the running max an integer
            if pingpong:   # consumer 1 hands consumer 0 the first turn
                with mu.when(arith.cmpi(arith.CmpIPredicate.eq, wg, ci(1))):
                    turn("bar.arrive", other_turn_bar)
            def consume_ahead(k, j, g, carry):
                """score_ahead: step g with step g + 1's score wgmma in flight under it (FlashAttention-3's
                intra-warpgroup overlap). carry: (m, l, acc, S of step g, complete). Issues S(g + 1) over this
                consumer's half of d, then runs step g's softmax and issues its P.V; waits for S(g + 1) alone,
                swaps partials with the other consumer while P.V runs, then waits for P.V and releases step g's
                slot. The tensor cores thus score the next block while the softmax runs, and the exchange runs
                under P.V. The consumers hold two ring slots at once (g's, g + 1's), so the ring needs a slot more
                than without it to keep the fill ahead. Past the last step the issued wgmma re-scores step g's own
                slot (no branch around a wgmma in flight) and its result is dropped unexchanged."""
                m, l, acc, scores = carry
                slot = arith.remui(g, c(n_ring))
                kv = mu.memref_slice(ring, slot)
                nxt = arith.addi(g, c(1))
                has_next = arith.cmpi(arith.CmpIPredicate.ult, nxt, total)
                slot_n = arith.select(has_next, arith.remui(nxt, c(n_ring)), slot)
                region = begin("c_wait_full")
                with mu.when(has_next):
                    wait_full(slot_n)
                end(region)
                s_next = issue_own_scores(mu.memref_slice(ring, slot_n))
                valid = valid_from(first_entry(k, j, g))   # (idx_ring: slot g published by step g's barrier)
                region = begin("c_softmax")
                m_new, alpha, l, p = online_softmax(scores, valid, m, l)
                end(region)
                region = begin("c_pv")
                o_accs = issue_pv(rescaled_accumulators(acc, alpha, m, m_new), p, kv)
                end(region)
                region = begin("c_scores")
                nvvm.wgmma_wait_group_sync_aligned(1)   # S(g + 1), committed before P.V
                own = s_next.value
                (scores,) = when_else(has_next, lambda: [exchange_partials(own)], [own])
                end(region)
                region = begin("c_pv_wait")
                nvvm.wgmma_wait_group_sync_aligned(0)
                empty_bars[slot].arrive()
                end(region)
                return m_new, l, tuple(o_acc.value for o_acc in o_accs), scores

            def p_ready(op, slot):
                """asym: named barrier 12 + slot (256 threads): the scorer arrives once P and alpha of the step in
                ring slot `slot` are in shared memory, the helper waits on it."""
                llvm.inline_asm(ir.Type.parse("!llvm.void"), [arith.addi(ci(12), arith.index_cast(i32, slot))],
                                f"{op} $0, 256;", "r", has_side_effects=True)

            def consume_scorer(k, j, g, carry):
                """asym, consumer 0: S over all of d, the softmax, P and alpha published for the helper, then P.V
                over this consumer's output columns (P from registers)."""
                m, l, acc = carry
                slot = arith.remui(g, c(n_ring))
                region = begin("c_wait_full")
                wait_full(slot)
                end(region)
                kv = mu.memref_slice(ring, slot)
                region = begin("c_scores")
                # q at an offset the compiler cannot see is 0: otherwise it hoists the chain's 32 q descriptors
                # (64-bit each) out of the step loop and ptxas spills them
                zero = arith.index_cast(index, llvm.inline_asm(i32, [], "mov.u32 $0, 0;", "=r",
                                                               has_side_effects=True))
                s_acc = mgpu.WGMMAAccumulator.zero(BLOCK_H, bk)
                k_of = lambda p0, n_: mu.memref_transpose(mu.memref_slice(kv, (slice(None), mu.ds(c(p0), n_))),
                                                          (1, 0, 3, 2))   # K's d pieces [p0, p0 + n_), as B
                q_reg_pieces = q_reg_cols // tc
                if q_reg_cols:   # q's first columns from registers (A in registers: no shared-memory reads)
                    s_acc = mgpu.wgmma(s_acc, scorer_q[0], k_of(0, q_reg_pieces), swizzle=swz)
                if q_reg_cols < d:
                    q_view = mu.memref_slice(q_smem, (mu.ds(zero, BLOCK_H // 8),
                                                      mu.ds(c(q_reg_pieces), pieces - q_reg_pieces)))
                    s_acc = mgpu.wgmma(s_acc, q_view, k_of(q_reg_pieces, pieces - q_reg_pieces), swizzle=swz)
                nvvm.wgmma_commit_group_sync_aligned()
                valid = valid_from(first_entry(k, j, g))   # the entries' mask loads under the score chain
                nvvm.wgmma_wait_group_sync_aligned(0)
                end(region)
                region = begin("c_softmax")
                m_new, alpha, l, p = online_softmax(s_acc.value, valid, m, l)
                p.store_tiled(mu.memref_slice(x_p, slot), swizzle=swz)
                alpha.store_untiled(mu.memref_slice(x_a, slot), optimized=False)
                # our generic-proxy stores of P before the helper's wgmma (async proxy) reads them
                nvvm.fence_proxy(nvvm.ProxyKind.async_shared, space=nvvm.SharedSpace.shared_cta)
                p_ready("bar.arrive", slot)
                end(region)
                region = begin("c_pv")
                o_accs = issue_pv(rescaled_accumulators(acc, alpha, m, m_new), p, kv,
                                  role_cols[0] if uneven else None)
                nvvm.wgmma_wait_group_sync_aligned(0)
                empty_bars[slot].arrive()
                end(region)
                return m_new, l, tuple(o_acc.value for o_acc in o_accs)

            def consume_helper(k, j, g, carry):
                """asym, consumer 1: once the scorer's P of this step is published, the accumulator times its
                alpha and P.V over this consumer's output columns with P from shared memory. m and l pass through
                (the scorer's are the row's)."""
                m, l, acc = carry
                slot = arith.remui(g, c(n_ring))
                region = begin("c_wait_p")
                wait_full(slot)   # (long complete: the scorer waited for it; this orders the ring's TMA writes)
                p_ready("bar.sync", slot)
                end(region)
                region = begin("c_pv")
                alpha = fa.FragmentedArray.load_untiled(mu.memref_slice(x_a, slot), layout=fa.WGMMA_ROW_LAYOUT,
                                                        optimized=False)
                scaled = lambda: [a * alpha.broadcast_minor(dh // pv_parts) for a in acc]
                if lazy:   # alpha is exactly 1 on rows whose running max stayed
                    acc = when_else(warp_any(one_row > alpha), scaled, acc)
                else:
                    acc = scaled()
                kv = mu.memref_slice(ring, slot)
                o_accs = [mgpu.wgmma(mgpu.WGMMAAccumulator.from_registers(a), mu.memref_slice(x_p, slot),
                                     mu.memref_slice(kv, (slice(None), cols)), swizzle=swz)
                          for a, cols in zip(acc, role_cols[1] if uneven else pv_cols)]
                nvvm.wgmma_commit_group_sync_aligned()
                nvvm.wgmma_wait_group_sync_aligned(0)
                empty_bars[slot].arrive()
                end(region)
                return m, l, tuple(o_acc.value for o_acc in o_accs)

            one_row = fa.FragmentedArray.splat(arith.constant(f32, 1.0), (BLOCK_H,), fa.WGMMA_ROW_LAYOUT)

            def normaliser(m, l):
                """-> (lse without the sink, 1 / the output's denominator): one split divides by l + e^(sink - m),
                split-K partials by l alone."""
                has = l > 0.0
                l_safe = has.select(l, one_row)
                lse = has.select(m * LN2 + l_safe.log(approx=False),              # m is in log2 units
                                 fa.FragmentedArray.splat(arith.constant(f32, -math.inf), (BLOCK_H,),
                                                          fa.WGMMA_ROW_LAYOUT))
                if out_split or ccomb:
                    return lse, has.select(one_row / l_safe, zero_row)
                return lse, one_row / (l + (sink2 - m).exp2(approx=True))

            def output_parts(acc, inv):
                """The output parts acc x inv, bf16 (f16-typed bits with f16: the output tile holds bf16 bits in
                the f16 q tile, and o's gmem is declared f16 as well)."""
                o = [(a * inv.broadcast_minor(128 if uneven else dh // pv_parts)).astype(bf16) for a in acc]
                return [o_part.bitcast(f16_ty) for o_part in o] if f16 else o

            def store_o(o, cols_):
                for o_part, cols in zip(o, cols_):
                    o_part.store_tiled(mu.memref_slice(q_smem, (slice(None), cols)), swizzle=swz)

            def finish_role(m_, l_, acc_, scorer):
                """uneven: one consumer's steps are done; its output parts into the q tile, normalised by the
                scorer's 1 / denominator (to the helper through x_a's last row), once both consumers are past their
                last q.K (cons_bar). -> (m, l): the row's from the scorer, the helper's unused."""
                region_ = begin("c_epilogue_o")
                if scorer:
                    normaliser(m_, l_)[1].store_untiled(mu.memref_slice(x_a, n_ring), optimized=False)
                cons_bar.arrive()
                cons_bar.wait()
                inv_ = fa.FragmentedArray.load_untiled(mu.memref_slice(x_a, n_ring), layout=fa.WGMMA_ROW_LAYOUT,
                                                       optimized=False)
                store_o(output_parts(acc_, inv_), role_cols[0 if scorer else 1])
                end(region_)
                return m_, l_

            scorer_q = []   # q_reg_cols: the scorer's q columns [0, q_reg_cols) in registers, loaded in its branch

            def load_scorer_q():
                if q_reg_cols:
                    scorer_q[:] = [fa.FragmentedArray.load_tiled(
                        mu.memref_slice(q_smem, (slice(None), mu.ds(c(0), q_reg_cols // tc))), swizzle=swz,
                        layout=fa.WGMMA_LAYOUT)]

            if asym and uneven:   # each consumer its own registers, loop and output columns
                def role(scorer):
                    nvvm.setmaxregister(regs[2 if scorer else 3], nvvm.SetMaxRegisterAction.increase)
                    if scorer:
                        load_scorer_q()
                    return finish_role(*steps(consume_scorer if scorer else consume_helper,
                                              (m0, zero_row, role_acc0[0 if scorer else 1])), scorer)

                m, l = two_way(arith.cmpi(arith.CmpIPredicate.eq, wg, ci(0)), lambda: role(True), lambda: role(False),
                               (m0, zero_row))
            elif asym:   # each consumer its own loop over the steps
                def run_steps(fn):
                    if fn is consume_scorer:
                        load_scorer_q()
                    m_, l_, acc_ = steps(fn, (m0, zero_row, acc0))
                    return (m_, l_, *acc_)

                m, l, *acc = two_way(arith.cmpi(arith.CmpIPredicate.eq, wg, ci(0)), lambda: run_steps(consume_scorer),
                                     lambda: run_steps(consume_helper), (m0, zero_row, *acc0))
                acc = tuple(acc)
            elif ahead:   # step 0's scores before the loop (none where the CTA has no steps)
                total = total_steps()

                def first_scores():
                    wait_full(c(0))
                    return [split_d_scores(mu.memref_slice(ring, c(0)))]

                zero_s = fa.FragmentedArray.splat(arith.constant(f32, 0.0), (BLOCK_H, bk), fa.WGMMA_LAYOUT)
                (s0,) = when_else(arith.cmpi(arith.CmpIPredicate.ugt, total, c(0)), first_scores, [zero_s])
                m, l, acc, _ = steps(consume_ahead, (m0, zero_row, acc0, s0))
            else:
                m, l, acc = steps(consume, (m0, zero_row, acc0))
            if pingpong:   # consumer 0 takes consumer 1's last pass
                with mu.when(arith.cmpi(arith.CmpIPredicate.eq, wg, ci(0))):
                    turn("bar.sync", my_turn_bar)
            region = begin("c_epilogue")   # the final sums, the output tile and its store
            if split_scores:   # l = the two consumers' partial sums (both hold the same m)
                l.store_untiled(mu.memref_slice(x_l, wgi), optimized=False)
                consumers_barrier()
                l_h = [fa.FragmentedArray.load_untiled(mu.memref_slice(x_l, c(i)), layout=fa.WGMMA_ROW_LAYOUT,
                                                       optimized=False) for i in range(2)]
                l = l_h[0] + l_h[1]
            lse, inv = normaliser(m, l)   # (the helper's m / l are not the row's: only the scorer's lse is stored)
            if not uneven:   # (uneven: each consumer stored its output parts in finish_role)
                if asym:   # the scorer's normalisation is the row's: to the helper through x_a's last row
                    with mu.when(arith.cmpi(arith.CmpIPredicate.eq, wg, ci(0))):
                        inv.store_untiled(mu.memref_slice(x_a, n_ring), optimized=False)
                else:
                    o = output_parts(acc, inv)
                cons_bar.arrive()   # both consumers are past their last q.K: q_smem can hold the output
                cons_bar.wait()
                if asym:
                    inv = fa.FragmentedArray.load_untiled(mu.memref_slice(x_a, n_ring), layout=fa.WGMMA_ROW_LAYOUT,
                                                          optimized=False)
                    o = output_parts(acc, inv)
                store_o(o, pv_cols)
            with mu.when(arith.cmpi(arith.CmpIPredicate.eq, wg, ci(0))):
                lse.store_untiled(mu.memref_slice(vec_smem, mu.ds(BLOCK_H, BLOCK_H)), optimized=False)
                if split_d:   # the steps' exchange overwrote the sinks (both consumers are past it: cons_bar)
                    sink_raw.store_untiled(mu.memref_slice(vec_smem, mu.ds(0, BLOCK_H)), optimized=False)
            if ccomb:
                cluster_combine()
            else:
                mu.commit_shared()
                cons_bar.arrive()
                cons_bar.wait()
                with mu.when(arith.cmpi(arith.CmpIPredicate.eq, wg, ci(0))):
                    o_slice = (row, split, hg) if out_split else (row, hg)
                    ctx.async_copy(src_ref=q_smem, dst_ref=o_gmem, gmem_slice=o_slice,
                                   gmem_transform=mgpu.TileTransform((8, tc)), swizzle=swz, predicate=one)
                    ctx.async_copy(src_ref=mu.memref_slice(vec_smem, mu.ds(BLOCK_H, BLOCK_H)), dst_ref=lse_gmem,
                                   gmem_slice=o_slice, predicate=one)
                    ctx.await_async_copy(0, await_read_only=store_wait_read)
            end(region)
            scf.yield_([])
        if conv:   # the producer / rest split's else block: it holds the converter / consumers split
            with ir.InsertionPoint(if_op.else_block):
                scf.yield_([])

    op_dt = jnp.float16 if f16 else jnp.bfloat16   # q, o (bits) and the tensor cores' operands in shared memory
    in_shape = [jax.ShapeDtypeStruct((bt, n_hg, BLOCK_H, d), op_dt),
                jax.ShapeDtypeStruct((n_hg, BLOCK_H), jnp.float32)]
    for s_ in srcs:
        in_shape += [jax.ShapeDtypeStruct((bt, s_["k"]), jnp.int32), jax.ShapeDtypeStruct((bt,), jnp.int32)]
        if fp8:
            in_shape += [jax.ShapeDtypeStruct((s_["n_rows"], NOPE_DIM), jnp.float8_e4m3fn),
                         jax.ShapeDtypeStruct((s_["n_rows"], ROPE_DIM), jnp.bfloat16),
                         jax.ShapeDtypeStruct((s_["n_rows"], SCALE_BYTES), jnp.uint8)]
        else:
            in_shape += [jax.ShapeDtypeStruct((s_["n_rows"], d), jnp.bfloat16)]
    lead = ((bt, ns) if out_split else (bt,)) + (n_hg,)
    out_shape = (jax.ShapeDtypeStruct((*lead, BLOCK_H, d), op_dt),
                 jax.ShapeDtypeStruct((*lead, BLOCK_H), jnp.float32))
    # asym: P per ring slot (bf16, the helper's wgmma A operand: right after the ring, 1 KB aligned), and alpha per
    # ring slot + the final 1 / l (after sinks | lse)
    asym_p = jax.ShapeDtypeStruct((n_ring, BLOCK_H // 8, bk // tc, 8, tc), op_dt)
    asym_a = jax.ShapeDtypeStruct((n_ring + 1, BLOCK_H), jnp.float32)
    if tiles:
        # (direct stages nothing in shared memory: no staging buffers, no staging barriers)
        staging = () if direct else (
            jax.ShapeDtypeStruct((stages, bk, NOPE_STRIDE), jnp.float8_e4m3fn),      # staging: nope
            jax.ShapeDtypeStruct((stages, bk, ROPE_DIM), jnp.bfloat16),              # staging: rope
            jax.ShapeDtypeStruct((stages, bk, SCALE_BYTES), jnp.uint8))              # staging: scales
        # asym's P slots go right after the tile ring: Mosaic packs the buffers back to back, and the swizzled P
        # tiles need the 1 KB alignment the ring ends on (after the staging ring's 8 B scale rows they would not
        # have it: session 68's first GPU run of conv + asym read P through a misaligned swizzle)
        smem = (
            (jax.ShapeDtypeStruct((BLOCK_H // 8, d // tc, 8, tc), op_dt),     # q, then o
             jax.ShapeDtypeStruct((n_tiles, bk // 8, d // tc, 8, tc), op_dt),  # the bf16 (f16) tile ring
             *((asym_p,) if asym else ()),
             *staging,
             *((jax.ShapeDtypeStruct((idx_len,), jnp.int32),
                jax.ShapeDtypeStruct((2 * BLOCK_H,), jnp.float32), asym_a) if asym else      # asym | sinks, lse
               (jax.ShapeDtypeStruct((2, BLOCK_H // 8, bk // 32, 8, 32), jnp.float32),  # split_d's partials | sinks,
                jax.ShapeDtypeStruct((idx_len,), jnp.int32)))),                         # lse
            (mgpu.TMABarrier(1), mgpu.TMABarrier(1)),
            # staging: the expect_tx arrival + one cp.async arrival per producer warp; tile full: the 128 producer
            # threads; tile empty / cons: the 256 consumer threads
            (*(() if direct else (mgpu.Barrier(arrival_count=5, num_barriers=stages),)),
             *((mgpu.Barrier(arrival_count=128, num_barriers=stages),) if conv else ()),   # conv: staging released
             # tile full: 128 arrivals per converting warpgroup (conv_units < CONV_UNITS: converter and producer)
             mgpu.Barrier(arrival_count=256 if conv and p_units else 128, num_barriers=n_tiles),
             mgpu.Barrier(arrival_count=256, num_barriers=n_tiles), mgpu.Barrier(arrival_count=256)),
        )
    elif fp8:
        smem = (
            (jax.ShapeDtypeStruct((BLOCK_H // 8, d // 64, 8, 64), jnp.bfloat16),     # q, then o
             jax.ShapeDtypeStruct((bk // 8, d // 64, 8, 64), jnp.bfloat16),          # the dequantized KV block
             jax.ShapeDtypeStruct((stages, bk, NOPE_STRIDE), jnp.float8_e4m3fn),     # staging: nope
             jax.ShapeDtypeStruct((stages, bk, ROPE_DIM), jnp.bfloat16),             # staging: rope
             jax.ShapeDtypeStruct((stages, bk, SCALE_BYTES), jnp.uint8),             # staging: scales
             # split_d: the consumers' f32 partial scores, the sinks | lse inside them (as for bf16 pools)
             *((jax.ShapeDtypeStruct((2, BLOCK_H // 8, bk // 32, 8, 32), jnp.float32),) if split_d else ()),
             jax.ShapeDtypeStruct((idx_len,), jnp.int32),
             *(() if split_d else (jax.ShapeDtypeStruct((2 * BLOCK_H,), jnp.float32),))),
            (mgpu.TMABarrier(1), mgpu.TMABarrier(1)),
            # full: the expect_tx arrival + one cp.async arrival per producer warp; empty / cons: 256 consumer threads
            (mgpu.Barrier(arrival_count=5, num_barriers=stages), mgpu.Barrier(arrival_count=256, num_barriers=stages),
             mgpu.Barrier(arrival_count=256)),
        )
    else:
        # split_scores: P halves and row maxima per (step parity, consumer), the final partial sums. Mosaic packs the
        # scratch buffers back to back with no padding, so they go right after the ring (1 KB aligned), not after
        # the barriers (8 mod 16 B: the session-10 layout, kept as _diag="ss_tail")
        exch = (jax.ShapeDtypeStruct((2, 2, BLOCK_H, bk // 2), jnp.bfloat16),
                jax.ShapeDtypeStruct((2, 2, BLOCK_H), jnp.float32),
                jax.ShapeDtypeStruct((2, BLOCK_H), jnp.float32)) if split_scores else (asym_p,) if asym else ()
        tail = split_scores and diag == "ss_tail"
        if split_d:   # the consumers' f32 partial scores, (8, 32) tiles with 128 B swizzle; sinks | lse alias them
            smem = (
                (jax.ShapeDtypeStruct((BLOCK_H // 8, d // tc, 8, tc), jnp.bfloat16),     # q, then o
                 jax.ShapeDtypeStruct((stages, bk // 8, d // tc, 8, tc), jnp.bfloat16),  # KV ring
                 jax.ShapeDtypeStruct((2, BLOCK_H // 8, bk // 32, 8, 32), jnp.float32),  # partial S per consumer
                 jax.ShapeDtypeStruct((idx_len,), jnp.int32)),
                # full: per slot (piece_bars: per slot and piece of d, slot-major)
                (mgpu.TMABarrier(1), mgpu.TMABarrier(1),
                 mgpu.Barrier(arrival_count=128, num_barriers=stages) if cp_async else
                 mgpu.TMABarrier(stages * (pieces if piece_bars else 1))),
                (mgpu.Barrier(arrival_count=256, num_barriers=stages), mgpu.Barrier(arrival_count=256)),
            )
        else:
            smem = (
                (jax.ShapeDtypeStruct((BLOCK_H // 8, d // tc, 8, tc), jnp.bfloat16),     # q, then o
                 jax.ShapeDtypeStruct((stages, bk // 8, d // tc, 8, tc), jnp.bfloat16),  # KV ring
                 *(() if tail else exch),
                 jax.ShapeDtypeStruct((idx_len,), jnp.int32),                        # this split's index rows
                 jax.ShapeDtypeStruct((2 * BLOCK_H,), jnp.float32),                      # sinks | lse
                 *((asym_a,) if asym else ())),
                # full: the expect_tx arrival (TMA), or the 128 producer threads' cp.async arrivals
                (mgpu.TMABarrier(1), mgpu.TMABarrier(1),
                 mgpu.Barrier(arrival_count=128, num_barriers=stages) if cp_async else mgpu.TMABarrier(stages)),
                (mgpu.Barrier(arrival_count=256, num_barriers=stages), mgpu.Barrier(arrival_count=256)),
                *((exch,) if tail else ()),
            )
    if diag != "ss_tail":   # (the session-10 layout puts its exchange after the barriers on purpose)
        _check_swizzle_alignment(smem)
    prof = None if profile is None else mgpu.profiler.ProfilerSpec(profile[0], dump_path=profile[1])
    with jax_mlir.make_ir_context(), ir.Location.unknown():
        return mgpu.as_gpu_kernel(body, grid=(bt * n_hg, ns, 1), block=(512 if conv else 384, 1, 1),
                                  in_shape=tuple(in_shape),
                                  out_shape=out_shape, smem_scratch_shape=smem, prof_spec=prof,
                                  cluster=(1, ns, 1) if ccomb else (1, 1, 1))


MAX_CLUSTER = 8           # portable thread-block cluster size: combine="cluster" takes at most 8 splits per row
DEFAULT_MOSAIC_COMBINE = "auto"  # the split-K merge when combine=None (see resolve_combine)
DEFAULT_IDX_FIRST = True       # see `sparse_attention_mosaic`'s idx_first (H200, session 17: prefill 4-7% faster)
DEFAULT_STORE_WAIT = "read"    # see `sparse_attention_mosaic`'s store_wait (timed with idx_first, session 17)
DEFAULT_PINGPONG = False       # see `sparse_attention_mosaic`'s pingpong (H200, session 17: no gain)
DEFAULT_SPLIT_D = True         # split_d where it applies (see `sparse_attention_mosaic`'s split_d; session 18)
DEFAULT_CLUSTER_LOADS = "early"   # see `sparse_attention_mosaic`'s cluster_loads (H200, session 18: 1-2.5% faster)
# see `sparse_attention_mosaic`'s lazy_rescale: on for FP8 pools since session 26 (measured faster there); bf16 pools
# keep the eager update (within the noise), and split_scores always does
DEFAULT_LAZY_RESCALE = {"fp8": True, "bf16": False}
DEFAULT_CONV_BATCH = 1   # see `sparse_attention_mosaic`'s conv_batch
Q_F16_BATCH = 4          # fp8_operands="f16": 16 B chunks of q a consumer thread loads before it converts and stores
# the `_diag` conversions the tile ring's converting warpgroup (producer or converter) takes: "bits" (exact, no
# conversion instruction) and "no_convert" (raw bytes stored as bf16: wrong output, the bound on what converting costs)
# and "no_q_convert" (fp8_operands="f16" only: q's bits read as f16 without converting them, the bound on what q's
# in-kernel conversion costs)
TILE_RING_DIAGS = ("bits", "no_convert", "no_q_convert")
# FP8 decode's defaults since session 71 (H100, h100_s71r1: the five together against session 70's defaults, net of
# dispatch, CSA B=64 -11%, HCA-8K B=64 -15%, HCA-1K B=128 -13%, 16K prefill -11%; with them set, the FP8-cache model
# test and 285 of the 297 FP8 kernel cases passed, the other 11 stopping at two refusals the defaults now yield to,
# h100_s71r2): f16 operands, the converter's "owned" chunk order, the producer's bulk row copies, a quarter of P.V on
# the helper and q's first 256 columns in the scorer's registers.
# see `sparse_attention_mosaic`'s fp8_operands: the tensor cores' operand type over the converter's tiles under asym
DEFAULT_FP8_OPERANDS = "f16"
DEFAULT_ASYM_Q_REGS = 256   # see `sparse_attention_mosaic`'s asym_q_regs (with the uneven split only)
DEFAULT_ASYM_SCORER_COLS = 128   # see `sparse_attention_mosaic`'s asym_scorer_cols
DEFAULT_FP8_COPY = "bulk"   # see `sparse_attention_mosaic`'s fp8_copy
DEFAULT_FP8_CONVERT = "cvt"   # see `sparse_attention_mosaic`'s fp8_convert
DEFAULT_FP8_OVERLAP = False   # see `sparse_attention_mosaic`'s fp8_overlap (H200, session 20: no faster)
# fp8_chunk_order per fp8_dequant mode (see `sparse_attention_mosaic`): H200 session 25, the diagonal order takes
# 10-18% off the converter mode and makes it the fastest FP8 path; the consumers' own conversion got slower with it.
# The converter's "owned" order (session 69) since session 71, with the f16 operands above
DEFAULT_FP8_CHUNK_ORDER = {"consumers": "rows", "producer": "diagonal", "converter": "owned", "direct": "diagonal"}
DEFAULT_FP8_DEQUANT = "converter"   # see `sparse_attention_mosaic`'s fp8_dequant (H200 session 25, diagonal order)
DEFAULT_L2_AHEAD = 0      # L2 prefetch distance in steps (see `sparse_attention_mosaic`'s l2_ahead)
DEFAULT_PRODUCER = "tma"   # the bf16 ring's gather (see `sparse_attention_mosaic`'s producer)
DEFAULT_REGS = (56, 224)   # setmaxnreg: (producer, each consumer) registers per thread
# see `sparse_attention_mosaic`'s consumers. bf16: "asym" since session 66, measured faster on an H100 (session 65:
# decode 0-6.5%, prefill 9-10%, CSA B=64 within the noise); its kernel cases pass there (19 + the 118 bf16 cases with
# it as the default, session 65) and so does the bf16 model test with it forced (session 66, logit error 0.006, the
# Triton kernel's). FP8: "asym" over the converter warpgroup's 32-row tiles since session 68 (H100, group s67a, two
# calls, net us pair -> asym: CSA B=64 27.8-30.5 -> 27.0-29.7, B=128 43.5-43.7 -> 37.4-39.2, HCA-1K B=128 70.0-75.6 ->
# 62.9-66.2, HCA-8K B=64 231.6-241.3 -> 212.3-224.8, prefill S=16K 290-294 -> 322-324 TFLOP/s; CSA B=16 within the
# noise); all 219 FP8 kernel cases pass with it as the default and so does the FP8-cache model test (logit error
# 0.0096, the pair's)
DEFAULT_CONSUMERS = {"bf16": "asym", "fp8": "asym"}


def resolve_combine(how, out_dtype):
    """The Mosaic kernel's split-K merge: "xla" / "pallas" (`combine.combine`, a second kernel over the partials),
    "cluster" (inside the kernel, through distributed shared memory; bf16 output only: the kernel rounds the
    merged output to bf16), or "auto" (None = DEFAULT_MOSAIC_COMBINE): "cluster" where the output is bf16, the
    row has 2-8 splits and the rows' clusters all fit on the GPU at once (`cluster_occupancy`), else "xla"; settled
    by `_auto_combine` once the split count is known."""
    how = how or DEFAULT_MOSAIC_COMBINE
    if how == "auto":
        return how
    if how == "cluster":
        if jnp.dtype(out_dtype) != jnp.bfloat16:
            raise ValueError(f"combine='cluster' writes the merged output in bf16; out_dtype={jnp.dtype(out_dtype)} "
                             "needs combine='xla' or 'pallas'")
        return how
    return combine_lib.resolve(how)


def _auto_combine(rows, ns, smem, out_dtype, device_ordinal=0, threads=384):
    """combine="auto" for `rows` (query rows x head groups) clusters of `ns` CTAs with `smem` bytes each. A cluster
    grid that does not fit on the GPU at once runs in two waves (H200: CSA B=32's 32 clusters of 4 took 37.5 us
    against 18.9 with the XLA merge, HCA-8K B=16's 16 of 8 137 against 65), so then the XLA merge."""
    if ns == 1 or ns > MAX_CLUSTER or jnp.dtype(out_dtype) != jnp.bfloat16:
        return "xla"
    from .cluster_occupancy import max_active_clusters

    cap = max_active_clusters(ns, smem, threads, device_ordinal)
    return "cluster" if cap is not None and rows <= cap else "xla"


def _fewer_splits_that_fit(rows, ns, total_blocks, smem, out_dtype, device_ordinal=0, threads=384, block_k=64):
    """combine="auto" with the default split count, where the rows' clusters of `ns` CTAs do not fit on the GPU at
    once (so the XLA merge): the largest split count below ns whose clusters do fit, if a CTA then gathers at most
    64 entries more (one 64-row step, two of FP8's 32-row ones), else None. The XLA merge and its launch gap cost
    more than one step at small batches (H100, session 56, kernel time: CSA B=32, 4 splits + the XLA merge 16.3 +
    4.4 us, 3 splits in clusters 19.9; HCA-1K B=32 23.8 + 4.5 against 25.6), not than five (HCA-8K B=16: 8 splits
    + the XLA merge 62.2 + 4.8 us against 72.0 for 6 splits in clusters)."""
    steps = -(-total_blocks // ns)
    for fewer in range(min(ns, MAX_CLUSTER + 1) - 1, 1, -1):
        if (-(-total_blocks // fewer) - steps) * block_k > 64:
            return None
        if _auto_combine(rows, fewer, smem, out_dtype, device_ordinal, threads) == "cluster":
            return fewer
    return None


def profile_entries(max_steps):
    """i32 entries per warpgroup for the profiler: 3 header words, then 4 per region (enter and exit, each a name and
    a clock); at most 5 regions per step (consumers, FP8) plus 2 outside the loop, and a margin. A multiple of 64:
    warpgroup w's shared slice starts at w x entries words, and the profiler's `st.shared.v2.u32` needs 8 B
    alignment (an odd count faults with "misaligned address" in every warpgroup but the first)."""
    n = 3 + 4 * (5 * max_steps + 5) + 16   # outside the loop: c_wait_q, c_epilogue and the cluster merge's 3
    return -(-n // 64) * 64


def _device_ordinal(x):
    """The CUDA ordinal of the device x lives on (0 under tracing without a committed device)."""
    try:
        return int(next(iter(x.devices())).local_hardware_id or 0)
    except Exception:   # tracers have no devices
        return 0


LAUNCH_REGS = 168   # registers per thread a 384-thread CTA starts with: 65536 / 384, rounded down to a multiple of 8
CONV_REGS = (40, 56, 208)   # fp8_dequant="converter": (producer, converter, consumer); 512 threads start with 128 each
CONV_SHARED_REGS = (56, 56, 200)   # ... with conv_units < CONV_UNITS: the producer converts too
UNEVEN_REG_SHIFT = 24   # asym_scorer_cols < d / 2: registers from the scorer to the helper (its third accumulator)
# fp8_dequant="direct": (producer, consumer) registers. The producer holds a batch of loaded chunks (4 registers each,
# + a scale byte) next to its addresses. Offline ptxas (session 55, CSA decode, block_k 64): bf16's consumers spill
# 36 B at 208 (0 at 224); the direct kernel spills 84 B with batches of 2-6 chunks, 232 B with 9, 904 B with 18, and
# more where the producer has fewer registers (432 B at 56, batch 2)
DIRECT_REGS = (80, 208)
DIRECT_BATCH = 6   # fp8_dequant="direct": conv_batch's default, 16 B chunks loaded at once (a 64-row step has 18)
DIRECT_RAW_PIECE = 3   # direct_staging="tile": raw nope rows in pieces 3-6 of their own tile (chunks 0-11 -> 0-2 first)
DEFAULT_DIRECT_PREFETCH = False   # see `sparse_attention_mosaic`'s direct_prefetch (H100 session 55: no faster)
DEFAULT_DIRECT_STAGING = "tile"   # see `sparse_attention_mosaic`'s direct_staging (H100 session 55: the faster one)
# decode shapes only (< SPLIT_SCORES_MIN_T queries a sequence): see `sparse_attention_mosaic`'s piece_barriers
DEFAULT_PIECE_BARRIERS = "rows"
DEFAULT_SCORE_AHEAD = False   # see `sparse_attention_mosaic`'s score_ahead (H100 session 61: 7-16% slower, off)
AHEAD_TILES, AHEAD_STAGING = 3, 2   # score_ahead's FP8 tile ring: a tile more, a staging slot less (what fits)


def check_conv_regs(regs, shared=False, uneven=False):
    """(producer, converter, consumer) for the 512-thread kernel of fp8_dequant="converter": multiples of 8 in
    [24, 256], producer and converter <= 128 (what each thread starts with), consumer >= 128, and producer +
    converter + 2 x consumer <= 512 (the pool setmaxnreg draws on; see check_regs). setmaxnreg's regions let
    code use more than 128, but ptxas checks each single instruction against the launch's 128 first, so the
    consumers issue P.V as two m64n128 wgmmas (64 accumulator registers each; one m64n256 needs 158 and ptxas
    rejects the kernel, H200 session 23). uneven (asym_scorer_cols below d / 2): (producer, converter, scorer,
    helper), the same rules with the two consumers' counts apart (default: the consumers' count of the 3-tuple
    default, 24 less for the scorer, 24 more for the helper and its three accumulators)."""
    if regs is None:
        p_, v_, c_ = CONV_SHARED_REGS if shared else CONV_REGS
        regs = (p_, v_, c_ - UNEVEN_REG_SHIFT, c_ + UNEVEN_REG_SHIFT) if uneven else (p_, v_, c_)
    regs = tuple(regs)
    n_cons = 2 if uneven else 1
    if len(regs) != 2 + n_cons or any(r % 8 or not 24 <= r <= 256 for r in regs) or regs[0] > 128 \
            or regs[1] > 128 or min(regs[2:]) < 128 or regs[0] + regs[1] + sum(regs[2:]) * (3 - n_cons) > 512:
        raise ValueError(f"with fp8_dequant='converter' regs must be (producer, converter, consumer) (with "
                         f"asym_scorer_cols: (producer, converter, scorer, helper)): multiples of 8 in [24, 256], "
                         f"producer and converter <= 128, consumers >= 128, all of them (the consumer twice) <= 512 "
                         f"(a 512-thread CTA starts with 128 registers per thread), got {regs}")
    return tuple(int(r) for r in regs)


def check_regs(regs):
    """(producer, consumer) per-thread register counts for `setmaxnreg`: multiples of 8 in [24, 256] that the
    registers the CTA starts with can cover: producer + 2 x consumer <= 3 x LAUNCH_REGS = 504, not the SM's 512.
    `setmaxnreg.inc` waits until the pool holds the registers it asks for, which only the producer's decrease
    refills: with (96, 208) the consumers ask for 10240 registers while the producer frees 9216, and the kernel
    hangs (H200, session 22). The default (56, 224) is exactly 504."""
    p_, c_ = regs or DEFAULT_REGS
    if any(r % 8 or not 24 <= r <= 256 for r in (p_, c_)) or p_ + 2 * c_ > 3 * LAUNCH_REGS or p_ > LAUNCH_REGS \
            or c_ < LAUNCH_REGS:
        raise ValueError(f"regs must be (producer <= {LAUNCH_REGS}, consumer >= {LAUNCH_REGS}), multiples of 8 in "
                         f"[24, 256] with producer + 2 * consumer <= {3 * LAUNCH_REGS} (the registers a 384-thread "
                         f"CTA starts with; more makes setmaxnreg wait forever), got {regs}")
    return int(p_), int(c_)


def sparse_attention_mosaic(
    q,
    window_kv,
    window_idx,
    compressed_kv,
    compressed_idx,
    sinks,
    *,
    scale: float,
    window_len=None,
    compressed_len=None,
    out_dtype=None,
    return_lse: bool = False,
    block_k: int | None = None,
    num_stages: int | None = None,
    n_splits: int | None = None,
    regs: tuple[int, int] | None = None,
    split_scores: bool | None = None,
    producer: str | None = None,
    l2_ahead: int | None = None,
    combine: str | None = None,
    store_wait: str | None = None,
    idx_first: bool | None = None,
    pingpong: bool | None = None,
    cluster_loads: str | None = None,
    split_d: bool | None = None,
    fp8_convert: str | None = None,
    fp8_overlap: bool | None = None,
    fp8_dequant: str | None = None,
    conv_units: int | None = None,
    fp8_chunk_order: str | None = None,
    tile_slots: int | None = None,
    conv_batch: int | None = None,
    direct_staging: str | None = None,
    direct_prefetch: bool | None = None,
    idx_stream: bool | None = None,
    lazy_rescale: bool | None = None,
    piece_barriers: bool | str | None = None,
    score_ahead: bool | None = None,
    consumers: str | None = None,
    fp8_operands: str | None = None,
    fp8_copy: str | None = None,
    asym_scorer_cols: int | None = None,
    asym_q_regs: int | None = None,
    _diag: str | None = None,
    _profile: str | None = None,
):
    """Mosaic GPU implementation of `reference.sparse_attention` for bf16 q [B, T, H, d] (H a multiple of 64: one
    CTA per group of 64 heads) and either bf16 [rows, d] pools (d a multiple of 128) or FP8 pools (`Fp8KVPool`,
    d = 512; both sources FP8, dequantized in shared memory by the consumers). Knobs: block_k (entries per step, a
    multiple of 64, <= 256, or 32 with bf16 pools: 64 B swizzle; with num_stages=4 the ring holds four 32-entry slots
    in the same 128 KB, so the producer keeps up to three in flight while the consumers hold one. Gathered with
    cp.async: a bulk tensor copy's destination must be 128 B aligned, which 64 B rows are not. H200, session 15:
    kernels 1-5% faster than block_k=64, not the default. FP8: 64), num_stages (ring depth),
    n_splits (split-K; default about one CTA per SM), regs ((producer, consumer) registers per thread set by
    `setmaxnreg`, at most 504 in all, see check_regs; default DEFAULT_REGS; (40, 232) and (24, 240) measured within
    the run-to-run noise, session 10; (producer, converter, consumer) with fp8_dequant="converter", check_conv_regs).
    `_diag` (FP8, timing diagnostics, wrong output unless noted):
    "bits" dequantizes without conversion instructions (correct, slower), "loop" converts in a rolled loop (correct
    on the H200, ptxas spills 1264 instead of 1416 B; not timed), "no_convert" stores the raw bytes instead of
    dequantizing, "no_dequant" skips the staging -> tile pass (only its
    barriers remain), "no_scales" skips the scale copies.
    split_scores (bf16 pools; None = on from SPLIT_SCORES_MIN_T queries per sequence where split_d is off, see the
    module docstring; split_d replaced it as the prefill default in session 18):
    each consumer computes the scores of half the block's entries and the two exchange bf16 P halves through shared
    memory: 2/3 of the tensor work, one more barrier per block. The exchange buffers follow the KV ring: after the
    barriers (8 mod 16 B, Mosaic packs scratch without padding) the kernel faults with a misaligned address
    (sessions 10 and 12, diagnostic "ss_tail"). Diagnostic
    "ss_noexchange": each consumer uses only its own P half (wrong output; isolates the N = bk/2 score wgmma).
    producer (bf16 pools; None = DEFAULT_PRODUCER, or "cp_async" for block_k=32): how the producer warpgroup
    gathers a block's rows into the ring: "tma" (lane 0 of each warp issues one 128 B bulk copy per row and 128
    B-swizzle piece: 8 per 1 KB row) or "cp_async" (all 128 threads, one 16 B cp.async each per row chunk, written
    at the swizzled addresses; the consumers fence the async proxy before their wgmma reads). Session 14's phase
    profile: issuing the 512 bulk copies of a 64-row block took ~4700 cycles, the producer's whole step; session 15:
    cp.async issues it in ~3350 and then waits ~1550 for a slot, the same step time.
    l2_ahead (None = DEFAULT_L2_AHEAD; 0 = off): the producer prefetches the rows of the step `num_stages +
    l2_ahead` ahead into L2 (one `cp.async.bulk.prefetch.L2` per row), so more of the gather is in flight than the
    ring's slots hold (shared memory caps them at two 64-row blocks next to the q tile; the consumers hold one).
    combine (split-K merge: "xla" = `common.combine_splits`, two XLA kernels; "pallas" =
    `combine.combine_splits_pallas`, one Triton kernel; "cluster" = inside this kernel: a row's splits run as one
    thread-block cluster and merge through distributed shared memory, so n_splits <= 8 and bf16 output (see
    `cluster_combine` in `_build`); "auto" / None: "cluster" where it applies and the clusters fit on the GPU at
    once, else "xla", see `resolve_combine`).
    store_wait (None = DEFAULT_STORE_WAIT): what the CTA waits for after the output tile's bulk copy before it
    exits: "write" (the copy is complete in global memory) or "read" (the copy has read the tile out of shared
    memory: `cp.async.bulk.wait_group.read`, as CUTLASS's and FlashAttention-3's TMA epilogues do; the grid's end
    still orders the writes before any later kernel). "read" frees the SM for the next CTA a global-write latency
    earlier (prefill: one CTA per query row, 1 per SM). H200 (session 17): alone within noise; with idx_first,
    S=4K prefill 1098 vs 1118 µs net and CSA B=128 decode 41.3 vs 44.3 µs net, so "read" is the default.
    idx_first (None = DEFAULT_IDX_FIRST): the producer issues the index rows' bulk copies before the q tile's,
    not after. The gathers wait for the rows only; with q first, the rows queue behind 64 KB of q at the SM's
    ~14 B per cycle, and the setup phase took 1557-3804 cycles (session 14). H200 (session 17): the producer's
    setup 2980 -> 1479 cycles (CSA B=64); prefill S=16K 4461 -> 4297 µs net (308 -> 320 TFLOP/s), S=4K 1177 ->
    1118 µs; decode CSA B=128 45.7 -> 44.3 µs, B=64 unchanged. Default on.
    pingpong (None = DEFAULT_PINGPONG where it applies: bf16 pools without split_scores): the two consumer
    warpgroups take turns at the tensor cores (S of one, S of the other, P.V of one, P.V of the other), as
    FlashAttention-3's ping-pong schedule does, so one's softmax overlaps the other's wgmma. Session 17's phase
    profile of CSA B=128 decode: both consumers compute S at once (2333 cycles per step, the tensor cores at their
    peak for the two copies), then both run the softmax (1363) with the tensor cores idle, and the producer waits
    1053 cycles per step for a free slot. FP8 pools (the dequantization's shared barrier) and split_scores (the P
    exchange) already synchronise the consumers every step: pingpong=True raises there. Measured (session 17):
    no gain (CSA B=128 46.4 vs 44.9 us, HCA-8K B=16 78.7 vs 71.2): one warpgroup's N=64 S chain takes as long
    alone as two at once, so taking turns frees no tensor time. Off by default.
    cluster_loads (None = DEFAULT_CLUSTER_LOADS; combine="cluster" only): how a CTA reads its peers' partials
    in the in-kernel merge. "per_unit": one 8-head unit after another, each behind its own branch, so each unit's
    distributed-shared-memory reads wait for the previous unit's merge; "early": every read of all the CTA's units
    is issued first, then the merges run. Session 17's phase profile put the merge epilogue at ~10K cycles per CTA
    at CSA B=64 (2 splits) against ~3.8K for one split without a merge. H200 (session 18): the merge itself 3508 ->
    2645 cycles (CSA B=64), kernels (CUPTI) CSA B=16 15.95 -> 15.68 us, B=64 27.95 -> 27.24, HCA-1K B=64 40.02 ->
    39.45; "early" is the default.
    split_d (None = DEFAULT_SPLIT_D where it applies: not with an explicit split_scores / pingpong, and where its
    buffer fits next to the split's index rows, else off. FP8 pools: the 32 KB fit next to one staging slot only,
    so the default takes num_stages=1 there, and an explicit num_stages > 1 turns it off; each consumer then
    dequantizes only its own half of d, see the module docstring): each consumer computes the
    scores over its own half of d (q[:, half] K[:, half]^T: 16 chained m64n<bk>k16 wgmma instead of 32, at N = bk)
    and the two swap their f32 partials through a 32 KB shared buffer (two named barriers per step), so the score
    work is done once instead of twice. Both consumers then hold bit-identical scores (a + b == b + a), so their m
    and l agree as before. Session 17's phase profile: both consumers computing all of S took 2333 cycles per
    64-entry step with the tensor cores near their peak for the two copies; the score chain is latency-bound at
    N = 64 (split_scores, which halves N instead, gained 1.5-4% in decode, session 18). Unlike split_scores the
    running max stays a float, so the error matches the default's. H200 (session 18, kernel time, CUPTI): CSA B=16
    15.7 -> 13.6 us, B=64 27.3 -> 22.9, B=128 41.4 -> 34.9, HCA-1K B=64 39.4 -> 32.8 (+ the XLA merge then, see
    `_auto_combine`'s cap), HCA-8K B=16 64.4 -> 61.8; prefill (against split_scores, `sparse_attention.py --groups
    s18`) S=16K 4545 -> 3617 us (302 -> 380 TFLOP/s), S=4K 1259 -> 1134 us. The default since then.
    fp8_convert (FP8 pools; None = DEFAULT_FP8_CONVERT): how the consumers turn a staged e4m3 pair into bf16.
    "cvt": e4m3x2 -> f16x2 -> two f32, times the block scale, -> bf16x2 (four conversion instructions per pair);
    "rebias": e4m3x2 -> f16x2, then the f16 bits shifted into bf16 position (integer ops) and two exact bf16x2
    multiplies (one conversion per pair; see REBIAS_ASM). Both are exact. The guess behind it: the conversions'
    rate (16 per SM per cycle) binds the dequantization (session 14's phase profile: 4467 cycles per 64-row block).
    Measured on the H200 (session 19): no gain (CSA B=64 57.7 vs 56.2 us without split_d, 38.2 vs 38.5 and 34.6 vs
    34.1 with it), so the guess was wrong and "cvt" stays the default. The tile ring's modes took "rebias" from
    session 22 to 66 (the producer mode still does); in the converter warpgroup (the FP8 default) "cvt" is 1-7%
    faster on every row of the FP8 decode table and 5.5% in 16K prefill (H100, session 67, same call; phase
    profile at CSA B=128: the converter's 32-row step 2730 against 2939 cycles, the consumers' wait for a tile 311
    against 517), so the converter and the direct gather take "cvt" since. The integer route of "rebias" (three
    integer and two bf16 instructions a pair) costs the converter more issue than the conversions it saves.
    fp8_overlap (FP8 pools with split_d; None = DEFAULT_FP8_OVERLAP): each consumer converts its half of the block
    one 64-column piece at a time and issues that piece's score wgmma (4 k-steps) right away, asynchronously, so
    the next piece's conversion runs while the tensor cores score the last (one warpgroup barrier per piece instead
    of two per block). Without it a consumer converts its whole half, then scores it: on the H200 (session 19,
    CSA B=64) the FP8 step costs ~2500 cycles more than the bf16 one, about the dequantization, with the tensor
    cores idle meanwhile. Correct on the H200 (session 20) but no faster (kernel time, default vs overlap: CSA B=64
    34.4 vs 34.4 us, B=128 52.4 vs 57.4, HCA-8K B=16 80.8 vs 95.0): the asynchronous wgmma did not run under the
    conversions. So it is off by default.
    fp8_dequant (FP8 pools; None = DEFAULT_FP8_DEQUANT): who turns the staged e4m3 rows into the bf16 tile the
    wgmma read (the default, "converter", where no option needs the consumers to convert: see the session-25 note
    below). "consumers": each consumer its half of d, serially before its scores (session 20's
    phase profile: 3117 of the FP8 step's ~7900 cycles per 64 rows at CSA B=64, all of FP8's extra time over
    bf16). "producer": the producer warpgroup converts (all 128 threads, between issuing its gathers) into a ring
    of PDQ_TILES bf16 tiles that the consumers read like a bf16 ring, so the conversion of step g + 1 runs under
    the consumers' work on step g. Two 64-row bf16 tiles do not fit next to q, staging and split_d's exchange, so
    this mode takes block_k=32 (64 B swizzle, like bf16's 32-entry ring): 64 KB q + 2 x 32 KB tiles + num_stages
    (default PDQ_STAGING) x 20.7 KB staging + 16 KB exchange. split_d only; fp8_convert defaults to "rebias" here
    (one conversion instruction per pair: the producer converts alone, so its rate matters). H200 (session 22):
    correct (7 GPU tests), but not faster, so it is off. Kernel time (CUPTI), default vs producer: CSA B=16 18.7 vs
    13.4 us (8 splits; the XLA merge those need, 16 clusters of 8 do not fit, costs what the kernel saves: 20.0 vs
    21.9 us per op; 4 splits with the cluster merge: 19.8), B=64 34.4 vs 33.3, B=128 52.4 vs 59.0, HCA-8K B=16
    81.0 vs 94.2; FP8 prefill S=16K 5712 vs 6730 us. The phase profile (CSA B=128) shows the producer bound: per
    32-row step it converts for 2649 cycles and issues its 128 copies for 1474, ~4800 with the waits, while the
    consumers' bf16 step takes ~2700 and they wait 1541 cycles per step for a tile. One 1D bulk copy per row part
    instead of two tensor copies for the nope bytes (2 copies per row instead of 3) did not move it (58.7 us).
    fp8_dequant="converter" (built in session 22; its first GPU compile failed in session 23: ptxas checks every
    instruction against the 512-thread launch's 128 registers before applying setmaxnreg, and the m64n256 P.V
    wgmma needs 158, so this mode issues P.V as two m64n128 halves; then 128 registers, no spills, correct on the
    H200 (6 GPU tests) but not faster: CSA B=64 35.2 vs 37.1 us, B=128 55.5 vs 55.0, HCA-8K B=16 95.2 vs 89.7 net
    of dispatch, FP8 prefill S=16K 219 vs 238 TFLOP/s, so it is off): a fourth warpgroup (512 threads per CTA)
    converts the staging ring into the tile ring, so the producer only issues the copies (session 22's profile:
    1474 cycles per 32-row step) and the converter only converts (2649), each below the consumers' ~2700. Staging
    slots go back to the producer through the converter's 128 arrivals. regs is (producer, converter, consumer),
    default CONV_REGS = (40, 56, 208): a 512-thread CTA starts with 128 registers per thread, so 2 x 208 is what
    the consumers can have (224 today). Session 25: the converter's ~3700 cycles per step were shared-memory
    bank conflicts as much as work (see fp8_chunk_order): with the diagonal chunk order it converts in ~3190 and
    the mode is the fastest FP8 path on the H200 (net of dispatch, vs "consumers": CSA B=64 30.9 vs 37.9 us,
    B=128 48.3 vs 54.7, HCA-8K B=64 271 vs 308, B=16 78.8 vs 88.3; prefill S=16K 254 vs 237 TFLOP/s), so it is
    the default since.
    conv_units (fp8_dequant="converter" only; None = CONV_UNITS, the converter alone): the converter's share of
    each 32-row step's conversion, in CONV_UNITS = 9 passes of 128 chunks (7 nope passes, then 2 rope copies); the
    producer converts the rest, the step staged (num_stages - 1) steps before the one it just issued, as with
    fp8_dequant="producer". Session 24's phase profile: the converter alone needs ~3700 cycles per step while the
    consumers compute in ~2930 and the producer idles half its span, so splitting the conversion between the two
    should leave the consumers the bound. regs defaults to CONV_SHARED_REGS then (the producer converts too).
    fp8_chunk_order (FP8 pools; None = DEFAULT_FP8_CHUNK_ORDER): which 16-byte chunk of the staged block each
    converting thread takes: "rows" (row-major: a warp's consecutive threads walk one row) or "diagonal" (the 8
    threads of a 16-byte shared-memory phase take 8 rows, one chunk each, staggered), which spreads the swizzled
    bf16 stores over all 8 slots of a bank row (see chunk_coords: row-major stores conflict 2-way under the 128 B
    swizzle and 4-way under the tile ring's 64 B). Session 25: with the conversion split between the converter and
    the producer (conv_units) the conversion cycles summed over both stayed ~3700 per 32-row step, so the
    conversion is bound by a resource of the whole SM, shared memory, not by one warpgroup's issue rate.
    "owned" (session 69; the tile ring's 32-row steps, fp8_dequant "producer" / "converter"): thread t owns row
    t // 4 and its chunks t % 4 + 4 g, so a pass's addresses are static offsets from per-thread bases (no index
    division, no loop: the diagonal order's loop spends ~30 of its 80 instructions a chunk on 64-bit index
    arithmetic), odd rows start one chunk group further (their staged loads land in the other half of the bank
    row) and threads t % 4 >= 2 store a chunk's upper 16 B first: conflict-free loads (but the last nope pass)
    and stores. The converter's default since session 71 (with DEFAULT_FP8_OPERANDS' "f16").
    tile_slots (fp8_dequant="producer" / "converter"; None = PDQ_TILES = 2): the bf16 tile ring's depth. A third
    32-row tile (32 KB) lets the converters run a step further ahead of the consumers; it fits next to q, two
    staging slots (num_stages=2) and split_d's exchange in decode (~220 KB). Session 25's profile (converter with
    conv_units=5, diagonal order): both converting warpgroups idle a third of their span while the consumers still
    wait ~660 cycles a step for a tile, which a deeper ring may hide. Timed in session 26: no faster (CSA B=64 31.1
    vs 31.4 us, B=128 49.6 vs 47.9, with conv_batch=3), and HCA-8K B=64 20% slower for the staging slot it takes.
    Again on session 71's defaults (H100 session 73, group s72, regs (40, 64, 184, 224) / (32, 64, 184, 232)):
    decode and the in-kernel 16K prefill within one call's spread.
    fp8_dequant="direct" (session 55; FlashMLA's FP8 decode kernel keeps its producer in this shape): no staging
    ring and no bulk copies of raw rows. The producer's 128 threads gather each step's rows from global memory
    themselves (into the tile being filled, or into registers: direct_staging), convert them and store the bf16
    rows into a ring of tile_slots bf16 tiles (default 2 of block_k = 64 rows: without
    staging, two 64-row tiles fit next to q and split_d's 32 KB exchange), which the consumers read exactly as
    they read a bf16 ring. The point: the other modes stage 32-row steps (a third of shared memory is staging), so
    their consumers run m64n32 steps at ~3300 cycles per 32 rows, against ~2350 for bf16's 64-row steps (session
    26). regs default DIRECT_REGS. block_k=32 takes 4 tiles. split_d only. H100 (session 55, CUPTI kernel us,
    against the converter default in the same call): correct (37 GPU cases), but slower, so it is off: "tile"
    staging CSA B=64 34.6 vs 28.2, B=128 54.5 vs 44.2, HCA-8K B=64 272.4 vs 239.6, HCA-1K B=64 50.2 vs 42.3
    (bf16 pools: 25.8, 39.6, 204.8, 36.6); "registers" staging slower still (HCA-8K B=64 311.9). Why: with no
    buffer besides the two tiles, a step's fill can start only when the consumers release the tile two steps
    back, and it is serial: the copies' transfer, then the conversion (~6.4K cycles for 64 rows by one
    warpgroup; see direct_prefetch); at ~8.6K cycles per 64-row step it is longer than the consumers' step,
    while the converter mode's separate staging ring lets its converter work beside the next step's copies. A
    third place for raw rows (~29 KB) does not fit next to q, two 64-row tiles and split_d's exchange.
    direct_staging (fp8_dequant="direct"; None = DEFAULT_DIRECT_STAGING at block_k 64, else "registers"): where a
    step's raw rows wait between their load and their conversion. "registers": 16 B global loads into the
    producer's registers, conv_batch at a time (measured slower than the converter on the H100, session 55: the
    producer's 80 registers keep ~6 chunks a thread in flight, ~12 KB an SM, so it waits on memory latency:
    HCA-8K B=64 311.9 us, CSA B=64 35.9 in one call, against 272.4 and 34.6 with "tile" staging in another, the
    converter at 239.6-240.4 and 28.2-28.3 in both).
    "tile": 16 B cp.async copies (no registers held in flight) into the upper pieces of the tile being filled
    (`_build`'s direct_tile), converted from there in two phases.
    direct_prefetch (fp8_dequant="direct"; None = DEFAULT_DIRECT_PREFETCH): each step, the producer asks L2 for the
    next step's raw rows (`_build`'s direct_prefetch) before it loads this step's, so a fill's transfer would come
    from L2 and the HBM reads of step g + 1 run under step g's conversion. H100 (session 55, CUPTI kernel us, tile
    staging): no faster (HCA-8K B=64 271.4 vs 269.7, CSA B=64 35.2 vs 34.9), so it is off; one bulk prefetch per row
    part instead was slower (340.3 and 38.7) and is gone. That the transfer's latency is not what the fill waits on
    points at the conversion: one warpgroup converting a 64-row step takes ~6.4K cycles (the converter mode's
    converter, session 25: ~3190 per 32 rows), as long as a bf16 consumer step, and here it runs after the
    transfer instead of beside it.
    conv_batch (fp8_dequant="producer" / "converter"; None = DEFAULT_CONV_BATCH): chunks a converting thread loads
    before it converts and stores them. 1 = a loop over the step's passes, one 16-byte chunk at a time; there
    every chunk's loads wait for the previous chunk's stores (shared loads and stores may alias, so they stay in
    program order) and each chunk pays the whole load -> convert -> store latency with one warp per scheduler to
    hide it. 2-9 = the passes unrolled in batches of that many, all of a batch's loads first (more registers).
    lazy_rescale (None = DEFAULT_LAZY_RESCALE: FP8 pools on, bf16 off; not with split_scores): the online softmax
    keeps a row's running max m until a block's max passes it by LAZY_RESCALE_LOG2 = 8 (log2 units), so
    p = 2^(s - m) <= 2^8, and a consumer warp multiplies its output accumulator rows by alpha = 2^(m_old - m_new)
    only when one of its 16 rows moved m (a warp vote). Exact: lse and the final normalisation use the same m as every p (bf16's relative precision does
    not depend on p's scale; f32 l and o have range to spare). The eager update multiplies all 128 accumulator
    registers per thread every step; past the first blocks m rarely moves by 8. H200 (session 26, net of dispatch,
    lazy vs eager): FP8 CSA B=128 47.7 vs 48.8 us, HCA-8K B=64 249 vs 276, prefill S=16K 268 vs 253 TFLOP/s; bf16
    within noise at CSA (B=64 24.5 vs 27.3, B=128 36.7 vs 34.3), HCA-8K B=64 258 vs 262. On by default for FP8.
    conv_batch (session 26): no faster at 2 or 3 (CSA B=128 50.6 / 51.8 vs 47.9 us), much slower at 9 (spills).
    idx_stream (None = where needed): where a CTA's index rows live. False: the split's whole lists, loaded into
    shared memory at the start (~4 B an entry: 2.5 KB for a CSA decode row). True: a ring of a few steps' entries,
    which the producer fills from global memory a step ahead as it issues each step (`_build`'s idx_ring), so
    shared memory does not grow with the list. None: the whole lists where they fit next to the rest at the
    default split count, else streamed. Without it a long list (HCA: 8K + 128 entries a decode row, 33 KB) made
    the default split the row into short CTAs until the lists fit (HCA-8K B=64: 15 splits, 960 CTAs, and the XLA
    merge) or drop split_d / the FP8 tile ring. Not with producer="cp_async", l2_ahead or block_k > 128.
    piece_barriers (None = DEFAULT_PIECE_BARRIERS where it applies, with fewer than SPLIT_SCORES_MIN_T queries per
    sequence, else False; False, "rows" (= True) or "pieces"; bf16 pools, the TMA
    producer, split_d): the ring's full barriers per 128 B-swizzle piece of d (8 per 64-row slot) instead of per
    slot, and each consumer waits for each of its pieces just before that piece's score wgmma (see `_build`'s
    piece_bars). "rows": the producer issues a block row by row as without it (a row's 8 pieces together), so a
    piece's barrier completes once the block's last row has that piece; "pieces": all rows' piece p, then the
    next (the consumers' halves alternating), so each score chain starts after the block's first two pieces land,
    FlashMLA's fine-grained copy / GEMM pipelining. An explicit value other than False raises where it does not
    apply (also where split_d was turned off to fit the split's index rows).
    score_ahead (None = DEFAULT_SCORE_AHEAD; split_d without split_scores / pingpong / fp8_overlap /
    piece_barriers; FP8 pools through a tile ring): each consumer issues the next step's score wgmma before this
    step's softmax and waits for it only after issuing this step's P.V, so the tensor cores score block g + 1 while
    the softmax of block g runs, and the consumers' exchange of g + 1's partial scores runs under g's P.V
    (FlashAttention-3's intra-warpgroup overlap; `_build`'s consume_ahead). Without it a step is serial: scores,
    the exchange and the softmax with the tensor cores idle, then P.V (H200 session 26, FP8 CSA B=128: scores 1314 +
    softmax 685 + P.V 751 cycles a 32-row step, the tensor cores' share of which is ~1000). The consumers then hold
    two slots of the ring at once, so with FP8's tile ring the default becomes tile_slots=3 and num_stages=2 (what
    fits), and with a bf16 ring use block_k=32, num_stages=4. Correct on the H100 (16 GPU cases), but slower, so it
    is off. H100, session 61 (CUPTI kernel us, default / its ring alone / score_ahead): FP8 CSA B=64 28.2 / 28.4 /
    31.6, B=128 44.4 / 43.9 / 50.2, HCA-1K B=64 42.9 / 42.1 / 46.4, HCA-8K B=64 238.0 / 235.4 / 265.3; bf16 32-row
    steps CSA B=128 42.9 -> 42.6, HCA-8K B=64 215.1 -> 219.1 (the 64-row default: 40.6, 204.2). Why (phase profile,
    FP8 CSA B=128): issuing the next step's 16 m64n32k16 score wgmma takes ~1700 cycles before the softmax can
    start, i.e. the issue itself waits for the tensor cores (two consumers' chains, bound by their A operand's
    shared-memory reads at N = 32), so nothing runs under them; the step grew from ~4100 to ~5000 cycles.
    consumers (None = DEFAULT_CONSUMERS for the pools' dtype: "asym" for both since session 68; the "asym" default
    yields to the pair wherever an option names one of the pair's modes: split_d, split_scores, pingpong, piece_barriers
    or score_ahead given, block_k other than 64 (other than 32 over the converter's tiles), the cp.async producer, more
    than 4 ring slots, FP8 pools converted by fp8_dequant="consumers" or "producer", or an option that rules out the
    default converter, such as a (producer, consumer) regs pair): how the two consumer warpgroups share a step.
    H100, session 65 (`sparse_attention.py --groups s64`, net us, pair -> asym): bf16 CSA B=16 16.4 -> 15.5, B=64
    27.5 -> 27.9, B=128 43.0 -> 41.1, HCA-1K B=64 38.6 -> 37.9, HCA-8K B=16 69.9 -> 65.4, B=64 209.8 -> 200.9;
    prefill S=4K 899 -> 807, S=16K 3444 -> 3131 (399 -> 439 TFLOP/s). FP8 through the direct gather, CSA B=128
    55.3 -> 54.2 (the converter then: 46.0), HCA-8K B=64 278.3 -> 260.1 (249.9). "pair": the symmetric pair above
    (split_d, split_scores or pingpong, as resolved). "asym" (block_k 64: bf16 pools gathered by the bulk-copy
    producer, or FP8 pools with fp8_dequant="direct", which is then FlashMLA's whole FP8 decode shape; or FP8 pools
    with fp8_dequant="converter", the default, over its 32-row tiles (sessions 67-68; H100 pair -> asym in
    DEFAULT_CONSUMERS' note); not with split_d=True, split_scores, pingpong, piece_barriers or score_ahead): FlashMLA's
    decode split, see `_build`'s asym: consumer 0 scores over all of d, runs the softmax and hands P and its rescale
    factors to consumer 1 through shared memory (8 KB + 256 B a ring slot, 4 KB + 256 B over the converter's tiles);
    each runs P.V over its half of the output columns, consumer 1's of step g under consumer 0's scores of step g + 1.
    No partial-score exchange, one softmax instead of two.
    fp8_operands (None = DEFAULT_FP8_OPERANDS, "f16" since session 71, where it applies, i.e. not with a caller's
    fp8_convert="rebias", else "bf16"; session 69): the tensor cores' operand
    type over FP8 pools, "bf16" or "f16" (FP8 pools through fp8_dequant="converter" under consumers="asym" only).
    With "f16" the converter turns each e4m3 pair into f16 with one conversion instruction and two f16x2 multiplies
    by the block scale (F16_CVT_ASM) instead of four conversions and two f32 multiplies, the consumers convert q's
    tile to f16 in place once it has landed, and P is rounded to f16 (10 mantissa bits against bf16's 7, and P <=
    2^8 with the lazy rescale). Range: dequantized values and q are exact in f16 for magnitudes in [2^-14, 65504]
    (FP8 values are e4m3 x 2^k: 4 significant bits), rounded to f16's subnormal grid below it (absolute error <=
    2^-25), and inf above it, which turns the row's scores into inf / NaN: a cache or q outside f16's range fails
    loudly, never silently. `_diag="no_q_convert"` (with "f16") skips q's conversion: wrong output, the bound on
    what it costs.
    fp8_copy (None = DEFAULT_FP8_COPY; FP8 pools through a staging ring, i.e. every fp8_dequant but "direct";
    session 70): how the producer issues a raw row into its staging slot. "tma": three 2-D tensor copies (256 + 192
    nope bytes, 128 rope bytes) by lane 0 of each producer warp, row after row; "bulk": two 1-D bulk copies
    (`cp.async.bulk`: 448 and 128 bytes, no tensor map), still lane 0's. Why: at CSA B=128 the producer
    spends ~2000 cycles issuing a 32-row step (18.7 KB, ~9 B a cycle; H100 session 69 profile), about as long as
    the converter and the scorer take for it, so with a three-slot staging ring the converter waits for its rows.
    "bulk" is the default since session 71 (timed with the other four FP8 defaults of that session, see
    DEFAULT_FP8_OPERANDS' note).
    asym_scorer_cols (None = DEFAULT_ASYM_SCORER_COLS, 128 since session 71, over the FP8 converter's tiles under
    consumers="asym" unless regs is a 3-tuple, d / 2 elsewhere; session 70): the output columns whose P.V the
    scorer runs, 128 or d / 2 = 256; the helper runs the rest. Why 128: in FP8's asym the scorer (scores over all
    of d, the softmax, its P.V) sets the consumers' pace while the helper waits for its P through most of each step
    (the profile's c_wait_p plus the time its record lands after the named barrier: ~1800 of ~2500 cycles a step,
    H100 session 69), so a quarter of P.V moves to the helper (three m64n128 accumulators, 192 registers). FP8
    pools through fp8_dequant="converter" under asym only; regs is then (producer, converter, scorer, helper),
    default the 3-tuple's consumer count -/+ 24.
    asym_q_regs (None = DEFAULT_ASYM_Q_REGS, 256 since session 71, with asym_scorer_cols below d / 2, else 0; session
    70): q's first columns (a multiple of 64) that the scorer holds in registers as its score wgmma's A operand;
    the rest of q stays in shared memory. Why: with 32-row tiles the score chain (m64n32k16, both operands in shared
    memory) needs ~192 B a clock of shared memory at the tensor cores' peak against ~128 the SM has, and re-reads
    all of q every step (benchmarks/smem_traffic_model.py); 64 columns in registers cost the scorer 16 registers a
    thread and take 8 KB off every step. Same modes as asym_scorer_cols; pair it with asym_scorer_cols=128, which
    frees the scorer's registers (64 of its accumulator's).
    `_profile` (a directory): every call dumps a Chrome trace of each warpgroup's phases there (Mosaic GPU's
    on-device profiler; benchmarks/mosaic_phase_profile.py summarizes it). Diagnostic only: the
    records cost a few cycles each and the dump is a host callback per call."""
    call_args = dict(locals())   # for the fallback below: the default tile ring where it does not fit
    pair_modes = (("split_d", split_d), ("split_scores", split_scores), ("pingpong", pingpong),
                  ("piece_barriers", piece_barriers), ("score_ahead", score_ahead), ("fp8_overlap", fp8_overlap))
    fp8 = isinstance(window_kv, Fp8KVPool)   # FP8 pools (validated below: both sources alike)
    # FP8 pools run asym over a tile ring: the direct gather's (64-row steps) or the converter's (32-row steps)
    # (fp8_dequant=None: the module default, which is resolved below)
    dequant_asked = fp8_dequant or DEFAULT_FP8_DEQUANT
    over_converter = fp8 and dequant_asked == "converter"
    fp8_no_asym = fp8 and dequant_asked not in ("direct", "converter")
    asym_bk_ok = (block_k or 64) == 64 or (over_converter and block_k == 32)
    # what keeps asym from running besides the pair's own modes switched on (the converter's conversion diagnostics
    # run under asym too: "bits", and "no_convert" to bound what the conversion costs there)
    diag_misfit = _diag is not None and not (over_converter and _diag in TILE_RING_DIAGS)
    asym_misfit = fp8_no_asym or not asym_bk_ok or producer == "cp_async" or diag_misfit
    asym_slots_ok = num_stages is None or 1 <= num_stages <= 4
    consumers_defaulted = consumers is None
    if consumers is None:   # the default for the pools' dtype; the pair wherever an option names one of its modes
        consumers = DEFAULT_CONSUMERS["fp8" if fp8 else "bf16"]
        if consumers == "asym" and (any(v is not None for _, v in pair_modes) or asym_misfit or not asym_slots_ok):
            consumers = "pair"
    if consumers not in ("pair", "asym"):
        raise ValueError(f"consumers must be 'pair' or 'asym', got {consumers!r}")
    asym = consumers == "asym"
    if asym:
        clash = [name for name, v in pair_modes if v]
        if asym_misfit or clash:
            raise ValueError("consumers='asym' runs 64-row steps of bf16 rings gathered by the bulk-copy producer, or "
                             "FP8 pools through fp8_dequant='direct' (64-row steps) or 'converter' (32-row), without "
                             "split_d, split_scores, pingpong, piece_barriers, score_ahead, fp8_overlap or _diag "
                             f"(but {' / '.join(TILE_RING_DIAGS)} over the converter's tiles); got "
                             f"{'FP8 pools with fp8_dequant=' + repr(fp8_dequant) + ', ' if fp8_no_asym else ''}"
                             f"block_k={block_k}, producer={producer!r}" + (f", {', '.join(clash)}" if clash else ""))
        if not asym_slots_ok:
            raise ValueError(f"consumers='asym' takes 1-4 ring slots (a named barrier each), got {num_stages}")
        split_d, split_scores, pingpong, piece_barriers, score_ahead = False, False, False, False, False
    b, t, h, d = common.validate(q, window_kv, window_idx, compressed_kv, compressed_idx, sinks, window_len,
                                 compressed_len, scale)
    pools = [window_kv] + ([] if compressed_kv is None else [compressed_kv])
    def tile_ring_conflict(mode):
        """Why fp8_dequant=mode ("producer" / "converter": the bf16 tile ring) cannot run with these options, or
        None where it can."""
        if not fp8:
            return f"fp8_dequant={mode!r} dequantizes FP8 pools (bf16 pools need no conversion)"
        if (split_d is False and not (asym and mode in ("direct", "converter"))) or split_scores or pingpong \
                or fp8_overlap or (_diag is not None and (_diag not in TILE_RING_DIAGS or mode == "direct")):
            return (f"fp8_dequant={mode!r} runs with split_d (the consumers' bf16 steps; 'direct' and 'converter' "
                    "also with consumers='asym'), without split_scores / pingpong / fp8_overlap / _diag (but "
                    f"{' / '.join(repr(x) for x in TILE_RING_DIAGS)} with the tile ring's 'producer' / 'converter')")
        if mode == "direct":
            if (block_k or 64) not in (32, 64):
                return f"fp8_dequant='direct' takes block_k=64 (the default) or 32, got {block_k}"
            if num_stages is not None:
                return "fp8_dequant='direct' stages nothing in shared memory: num_stages does not apply"
        elif (block_k or 32) != 32:
            return (f"fp8_dequant={mode!r} takes block_k=32 (two bf16 tiles of 64 rows do not fit in shared "
                    f"memory next to the staging ring), got {block_k}")
        if mode == "converter" and regs is not None and len(regs) not in (3, 4):
            return (f"fp8_dequant='converter' takes regs as (producer, converter, consumer) or, with "
                    f"asym_scorer_cols, (producer, converter, scorer, helper), got {tuple(regs)} (a (producer, "
                    "consumer) split is the 384-thread kernel's)")
        return None

    dequant_defaulted = fp8_dequant is None
    if fp8_dequant is None:   # the default where it applies; the consumers convert where an option needs them to
        default_fits = DEFAULT_FP8_DEQUANT == "consumers" or tile_ring_conflict(DEFAULT_FP8_DEQUANT) is None
        if fp8 and not default_fits and asym:   # the consumers' own conversion runs under the pair only
            if consumers_defaulted:
                return sparse_attention_mosaic(**{**call_args, "consumers": "pair"})
            raise ValueError(f"consumers='asym' runs FP8 pools over the default tile ring (fp8_dequant="
                             f"{DEFAULT_FP8_DEQUANT!r}), which these options rule out: "
                             f"{tile_ring_conflict(DEFAULT_FP8_DEQUANT)}")
        fp8_dequant = DEFAULT_FP8_DEQUANT if default_fits else "consumers"
    if fp8_dequant not in ("consumers", "producer", "converter", "direct"):
        raise ValueError(f"fp8_dequant must be 'consumers', 'producer', 'converter' or 'direct', got {fp8_dequant!r}")
    pdq = fp8_dequant == "producer"
    conv = fp8_dequant == "converter"
    direct = fp8_dequant == "direct"
    fp8_chunk_order = fp8_chunk_order or DEFAULT_FP8_CHUNK_ORDER[fp8_dequant]
    if fp8_chunk_order not in ("rows", "diagonal", "owned"):
        raise ValueError(f"fp8_chunk_order must be 'rows', 'diagonal' or 'owned', got {fp8_chunk_order!r}")
    if fp8_chunk_order == "owned" and fp8_dequant not in ("producer", "converter"):
        raise ValueError("fp8_chunk_order='owned' gives each of 128 converting threads one row of a 32-row step: "
                         f"the tile ring's fp8_dequant='producer' or 'converter', got {fp8_dequant!r}")
    def check_ring_knob(name, value, lo, hi, what, modes):
        """An int knob of the tile ring (None: unset): in [lo, hi], and only with the fp8_dequant modes using it."""
        if value is not None and (fp8_dequant not in modes or isinstance(value, bool) or not isinstance(value, int)
                                  or not lo <= value <= hi):
            raise ValueError(f"{name} is {what}: an int in [{lo}, {hi}] with fp8_dequant="
                             f"{' or '.join(repr(m) for m in modes)}, got {value!r} with fp8_dequant={fp8_dequant!r}")

    check_ring_knob("conv_units", conv_units, 1, CONV_UNITS,
                    f"the converter warpgroup's share of a step's {CONV_UNITS} conversion passes", ("converter",))
    check_ring_knob("tile_slots", tile_slots, 2, 4, "the bf16 tile ring's depth", ("producer", "converter", "direct"))
    if direct:   # a step of block_k rows is block_k * 36 / 128 passes of 128 chunks
        check_ring_knob("conv_batch", conv_batch, 1, (block_k or 64) * 36 // 128,
                        "the chunks a producer thread loads at once", ("direct",))
    else:
        check_ring_knob("conv_batch", conv_batch, 1, CONV_UNITS, "the chunks a converting thread loads at once",
                        ("producer", "converter"))
    conv_shared = conv and conv_units is not None and conv_units < CONV_UNITS
    tiles = pdq or conv or direct   # the bf16 tile ring (32-row steps; direct: 64 by default)
    if score_ahead is not None and not isinstance(score_ahead, bool):
        raise ValueError(f"score_ahead must be a bool or None, got {score_ahead!r}")
    ahead = DEFAULT_SCORE_AHEAD and (tiles or not fp8) if score_ahead is None else score_ahead   # (checked below)
    n_tiles = (AHEAD_TILES if ahead and (pdq or conv) else PDQ_TILES) if tile_slots is None else tile_slots
    if lazy_rescale is not None and not isinstance(lazy_rescale, bool):
        raise ValueError(f"lazy_rescale must be a bool or None, got {lazy_rescale!r}")
    if direct_prefetch is not None and not direct:
        raise ValueError(f"direct_prefetch applies to fp8_dequant='direct' only, got it with "
                         f"fp8_dequant={fp8_dequant!r}")
    if direct_prefetch is not None and not isinstance(direct_prefetch, bool):
        raise ValueError(f"direct_prefetch must be a bool or None, got {direct_prefetch!r}")
    if direct_staging is not None and not direct:
        raise ValueError(f"direct_staging applies to fp8_dequant='direct' only, got it with "
                         f"fp8_dequant={fp8_dequant!r}")
    if tiles:
        conflict = tile_ring_conflict(fp8_dequant)
        if conflict:
            raise ValueError(conflict)
        if direct:   # no staging ring (num_stages = 1 only sizes the index ring's depth)
            block_k, split_d, num_stages = block_k or 64, not asym, 1
            if tile_slots is None and block_k == 32:
                n_tiles = 4
            if direct_staging is None:
                direct_staging = DEFAULT_DIRECT_STAGING if block_k == 64 else "registers"
            if direct_staging not in ("registers", "tile"):
                raise ValueError(f"direct_staging must be 'registers' or 'tile', got {direct_staging!r}")
            if direct_staging == "tile" and (block_k != 64 or conv_batch is not None):
                raise ValueError("direct_staging='tile' stages 64-row steps in the upper pieces of their own tile "
                                 f"(block_k=64, no conv_batch), got block_k={block_k}, conv_batch={conv_batch}")
        else:
            block_k, split_d = 32, not asym
            num_stages = (AHEAD_STAGING if ahead else PDQ_STAGING) if num_stages is None else num_stages
        # the producer converts alone, so its conversion rate was taken to matter (session 22, not re-timed); the
        # converter and the direct gather take the module default (session 67: "cvt" 1-7% faster than "rebias")
        fp8_convert = fp8_convert or ("rebias" if pdq else DEFAULT_FP8_CONVERT)
    over_conv_asym = fp8 and conv and asym   # FP8 pools through the converter's tiles under asym
    f16_fits = over_conv_asym and _diag != "bits"   # ("bits" builds bf16 bit patterns)
    if fp8_operands is None:
        # ("rebias" builds bf16 bit patterns, so a caller's rebias keeps bf16 operands)
        fp8_operands = DEFAULT_FP8_OPERANDS if f16_fits and fp8_convert != "rebias" else "bf16"
    if fp8_operands not in ("bf16", "f16"):
        raise ValueError(f"fp8_operands must be 'bf16' or 'f16', got {fp8_operands!r}")
    f16 = fp8_operands == "f16"
    if f16 and not f16_fits:
        raise ValueError("fp8_operands='f16' runs FP8 pools through fp8_dequant='converter' under consumers='asym' "
                         f"(not with _diag='bits'); got {'FP8' if fp8 else 'bf16'} pools, fp8_dequant={fp8_dequant!r}, "
                         f"consumers={consumers!r}, _diag={_diag!r}")
    if f16 and fp8_convert == "rebias":
        raise ValueError("fp8_convert='rebias' builds bf16 bit patterns: not with fp8_operands='f16'")
    if _diag == "no_q_convert" and not f16:
        raise ValueError("_diag='no_q_convert' skips q's conversion to f16: fp8_operands='f16' only")
    mode_got = f"got {'FP8' if fp8 else 'bf16'} pools, fp8_dequant={fp8_dequant!r}, consumers={consumers!r}"
    if asym_scorer_cols is None:
        # (a caller's 3-entry regs name one consumer count: the even split)
        asym_scorer_cols = DEFAULT_ASYM_SCORER_COLS if over_conv_asym and (regs is None or len(regs) == 4) \
            else d // 2
    if isinstance(asym_scorer_cols, bool) or not isinstance(asym_scorer_cols, int) \
            or asym_scorer_cols not in (128, d // 2):
        raise ValueError(f"asym_scorer_cols must be 128 or d / 2 = {d // 2} (the scorer's P.V columns), got "
                         f"{asym_scorer_cols!r}")
    uneven = asym_scorer_cols != d // 2
    if uneven and not over_conv_asym:
        raise ValueError("asym_scorer_cols below d / 2 moves P.V columns from the scorer to the helper over the FP8 "
                         f"converter's tiles: FP8 pools, fp8_dequant='converter', consumers='asym'; {mode_got}")
    if asym_q_regs is None:
        # (measured with the uneven split only: the even one's scorer holds twice the P.V accumulator)
        asym_q_regs = DEFAULT_ASYM_Q_REGS if uneven else 0
    if isinstance(asym_q_regs, bool) or not isinstance(asym_q_regs, int) or asym_q_regs % 64 \
            or not 0 <= asym_q_regs <= d:
        raise ValueError(f"asym_q_regs must be a multiple of 64 in [0, d = {d}] (q's columns the scorer holds in "
                         f"registers), got {asym_q_regs!r}")
    if asym_q_regs and not over_conv_asym:
        raise ValueError("asym_q_regs gives the scorer q's first columns in registers over the FP8 converter's tiles: "
                         f"FP8 pools, fp8_dequant='converter', consumers='asym'; {mode_got}")
    if regs is not None and len(regs) == 4 and not uneven:
        raise ValueError("regs as (producer, converter, scorer, helper) is for asym_scorer_cols below d / 2, got "
                         f"regs={tuple(regs)}")
    staged = fp8 and not direct   # FP8 rows through a staging ring (the producer's copies)
    if fp8_copy is None:
        fp8_copy = DEFAULT_FP8_COPY if staged else "tma"
    if fp8_copy not in ("tma", "bulk"):
        raise ValueError(f"fp8_copy must be 'tma' or 'bulk', got {fp8_copy!r}")
    if fp8_copy != "tma" and not staged:
        raise ValueError(f"fp8_copy={fp8_copy!r} issues FP8 rows into a staging ring: FP8 pools with an fp8_dequant "
                         f"other than 'direct' (which stages nothing), got {'FP8' if fp8 else 'bf16'} pools"
                         + (", fp8_dequant='direct'" if direct else ""))
    out_dtype = jnp.dtype(out_dtype or q.dtype)
    combine = resolve_combine(combine, out_dtype)
    store_wait = store_wait or DEFAULT_STORE_WAIT
    if store_wait not in ("read", "write"):
        raise ValueError(f"store_wait must be 'read' or 'write', got {store_wait!r}")
    cluster_loads = cluster_loads or DEFAULT_CLUSTER_LOADS
    if cluster_loads not in ("early", "per_unit"):
        raise ValueError(f"cluster_loads must be 'early' or 'per_unit', got {cluster_loads!r}")
    if any(isinstance(p_, Fp8KVPool) != fp8 for p_ in pools):
        raise ValueError("the Mosaic GPU kernel takes both pools bf16 or both FP8 (mixed pools: gpu.py)")
    if q.dtype != jnp.bfloat16 or (not fp8 and any(p_.dtype != jnp.bfloat16 for p_ in pools)):
        raise ValueError("the Mosaic GPU kernel takes bf16 q and bf16 [rows, head_dim] or Fp8KVPool pools "
                         "(other dtypes: gpu.py)")
    if h % BLOCK_H or d % 128:
        raise ValueError(f"the Mosaic GPU kernel needs a multiple of {BLOCK_H} heads and head_dim % 128 == 0, "
                         f"got {h}, {d}")
    n_hg = h // BLOCK_H   # head groups: one CTA per (row, group, split)
    split_d_default = split_d is None
    if split_d is None:   # the default for bf16 pools, decode and prefill (where it fits: see the loop below)
        # FP8: the 32 KB fit next to one staging slot only, so the default asks for one (num_stages=None) and
        # an explicit num_stages > 1 keeps split_d off
        split_d = DEFAULT_SPLIT_D and not split_scores and not pingpong and not (fp8 and (num_stages or 1) > 1)
    split_d = bool(split_d)
    if split_d and (split_scores or pingpong):
        raise ValueError("split_d (each consumer scores half of d and they exchange f32 partials) does not combine "
                         "with split_scores or pingpong")
    split_scores_default = split_scores is None
    if split_scores is None:
        split_scores = not fp8 and not split_d and t >= SPLIT_SCORES_MIN_T
    l2_ahead = DEFAULT_L2_AHEAD if l2_ahead is None else int(l2_ahead)
    if not 0 <= l2_ahead <= 8:
        raise ValueError(f"l2_ahead must be in [0, 8] steps, got {l2_ahead}")
    if producer not in (None, "tma", "cp_async"):
        raise ValueError(f"producer must be 'tma' or 'cp_async', got {producer!r}")
    if fp8 and producer == "cp_async":
        raise ValueError("producer='cp_async' gathers bf16 rows (FP8 pools: the staging ring's bulk copies)")
    if fp8 and split_scores:
        raise ValueError("split_scores does not fit in shared memory next to the FP8 staging ring (bf16 pools only)")
    if pingpong and (fp8 or split_scores):
        raise ValueError("pingpong takes turns between the consumers' wgmma: bf16 pools without split_scores only "
                         "(FP8's dequantization and split_scores' exchange synchronise the consumers every step)")
    pingpong = DEFAULT_PINGPONG and not (fp8 or split_scores or split_d) if pingpong is None else bool(pingpong)
    if score_ahead and (piece_barriers or split_scores or pingpong or fp8_overlap or split_d is False
                        or (fp8 and not tiles)):
        raise ValueError("score_ahead overlaps the next step's split_d score wgmma with this step's softmax: split_d "
                         "without split_scores, pingpong, fp8_overlap or piece_barriers, and FP8 pools only through "
                         "a tile ring (fp8_dequant 'converter', 'producer' or 'direct')")
    if piece_barriers is None:   # decode shapes (H100, session 56: decode 0-3.5% faster, prefill 2.5% slower)
        want_pieces = DEFAULT_PIECE_BARRIERS if t < SPLIT_SCORES_MIN_T and not ahead else False
    else:
        want_pieces = piece_barriers
    want_pieces = "rows" if want_pieces is True else want_pieces
    if want_pieces not in (False, "rows", "pieces"):
        raise ValueError(f"piece_barriers must be False, True / 'rows' or 'pieces', got {piece_barriers!r}")
    fp8_convert = fp8_convert or DEFAULT_FP8_CONVERT
    if fp8_convert not in ("cvt", "rebias"):
        raise ValueError(f"fp8_convert must be 'cvt' or 'rebias', got {fp8_convert!r}")
    if fp8 and not tiles and (block_k or 64) != 64:
        raise ValueError(f"with FP8 pools the Mosaic GPU kernel takes block_k=64 (shared memory; 32 with "
                         f"fp8_dequant='producer'), got {block_k}")
    bt = b * t
    bk0 = block_k or 64
    flat = [common.flatten_source(window_kv, window_idx, window_len, bt, bk0, clip=False)]
    if compressed_kv is not None:
        flat.append(common.flatten_source(compressed_kv, compressed_idx, compressed_len, bt, bk0, clip=False))
    total_blocks = sum(s_.k // bk0 for s_ in flat)
    cfg = default_config(bt * n_hg, total_blocks, decode=t < SPLIT_SCORES_MIN_T, block_k=bk0)
    for k_, v_ in dict(block_k=block_k, num_stages=num_stages, n_splits=n_splits).items():
        if v_ is not None:
            cfg[k_] = v_
    if fp8 and split_d and num_stages is None and not tiles:
        cfg["num_stages"] = 1   # split_d's buffer fits next to one FP8 staging slot (H200, session 19: see split_d)
    bk, stages = cfg["block_k"], cfg["num_stages"]
    # P.V contracts over block_k in groups of the ring's swizzle width: 64 entries with 128 B swizzle, or block_k =
    # 32 with 64 B swizzle (bf16 rings: smaller steps, more of them in flight); S's N is <= 256
    if not (bk == 32 and (not fp8 or tiles)) and (bk % 64 or bk > 256):
        raise ValueError(f"block_k must be a multiple of 64 and <= 256 (or 32 with bf16 pools or "
                         f"fp8_dequant='producer'), got {bk}")
    if tiles and not 1 <= stages <= 4:
        raise ValueError(f"fp8_dequant={fp8_dequant!r} takes 1-4 staging slots (num_stages), got {stages}")
    # a bulk tensor copy's shared-memory address must be 128 B aligned: with 64 B swizzle every odd row of an
    # (8, 32) tile starts 64 B into a 128 B line (session 15 on the H200: CUDA_ERROR_MISALIGNED_ADDRESS), so
    # 32-entry rings are gathered with 16 B cp.async
    if producer is None:
        producer = "cp_async" if bk == 32 and not fp8 else DEFAULT_PRODUCER
    if bk == 32 and producer == "tma" and not fp8:
        raise ValueError("block_k=32 (64 B swizzle) needs producer='cp_async': a 64 B row of a 64 B-swizzled tile "
                         "is not 128 B aligned, as a bulk tensor copy's destination must be")
    ring_bytes = (0 if direct else stages * bk * (NOPE_STRIDE + 2 * ROPE_DIM + SCALE_BYTES)) + \
        (n_tiles if tiles else 1) * bk * d * 2 if fp8 else stages * bk * d * 2

    def exchange_bytes():
        """The consumers' exchange buffers: split_scores' P halves, maxima and sums; split_d's two f32 [64, bk]
        partials, which hold the sinks | lse (counted below) inside them."""
        if split_d:
            return 2 * BLOCK_H * bk * 4 - 2 * BLOCK_H * 4
        if asym:   # P (bf16) and alpha per ring slot (the tile ring's with FP8), 1 / l
            slots = n_tiles if tiles else stages
            return slots * BLOCK_H * bk * 2 + (slots + 1) * BLOCK_H * 4
        return (4 * BLOCK_H * (bk // 2) * 2 + 4 * BLOCK_H * 4 + 2 * BLOCK_H * 4) if split_scores else 0

    cluster = combine == "cluster"
    max_splits = MAX_CLUSTER if cluster else total_blocks   # combine="cluster": a row's splits are one cluster
    # idx_stream: a ring of this many steps' entries, one more than the producer can run ahead of the consumers
    idx_ring_steps = stages + (n_tiles if tiles else 0) + 1
    ring_ok = producer != "cp_async" and not l2_ahead and bk <= 128
    if idx_stream and not ring_ok:
        raise ValueError("idx_stream=True streams the index rows through the TMA producer: not with "
                         "producer='cp_async' (block_k=32 with bf16 pools), l2_ahead or block_k > 128")
    stream = bool(idx_stream)

    def pieces_apply():
        """Whether piece_bars runs with the options as resolved so far (split_d may still be turned off below)."""
        return bool(want_pieces) and split_d and not (fp8 or producer == "cp_async" or split_scores or pingpong)
    if cluster and n_splits is not None and n_splits > MAX_CLUSTER:
        raise ValueError(f"combine='cluster' merges a row's splits in one thread-block cluster: n_splits <= "
                         f"{MAX_CLUSTER}, got {n_splits}")
    ns0 = max(1, min(int(cfg["n_splits"]), total_blocks, max_splits))
    bps = -(-total_blocks // ns0)
    min_bps = -(-total_blocks // max_splits)
    while True:   # a CTA holds its split's index rows: with the default n_splits, split further until they fit
        ns = -(-total_blocks // bps)
        idx_rows = [min(bps, s_.k // bk) * bk for s_ in flat]
        prof_entries = profile_entries(sum(idx_rows) // bk)   # per warpgroup, if profiled
        # + the mbarriers (8 B each: q, idx, cons, and full / empty per slot), which Mosaic packs after the buffers:
        # without them a ring that fills shared memory to the byte (block_k=32 x 5 slots) passed this check and
        # failed in Mosaic's own (232552 > 232448 B)
        idx_bytes = idx_ring_steps * bk * 4 if stream else sum(idx_rows) * 4
        pieces_bars = stages * (d // 64 - 1) if pieces_apply() else 0   # piece_bars' extra full barriers
        smem = BLOCK_H * d * 2 + ring_bytes + idx_bytes + 2 * BLOCK_H * 4 + exchange_bytes() + \
            (3 + (0 if direct else 2 * stages) + (2 * n_tiles if tiles else 0) + (stages if conv else 0)
             + pieces_bars) * 8 + \
            ((4 if conv else 3) * 4 * prof_entries + 1024 if _profile else 0)   # + the profiler's alignment
        if smem > SMEM_BUDGET and idx_stream is None and ring_ok and not stream:
            # the split's whole lists do not fit next to the rest: stream them, at the default split count
            stream, bps = True, -(-total_blocks // ns0)
            continue
        if smem <= SMEM_BUDGET or n_splits is not None or bps <= max(1, min_bps):
            if smem > SMEM_BUDGET and split_d and split_d_default and not tiles:
                # the default split_d where its 32 KB do not fit next to this split's index rows (an explicit
                # n_splits, or cluster-capped splits of a long list): the kernel without it, from the start
                # (FP8 keeps its one staging slot: two slots without split_d take 10 KB more than one with it)
                split_d, bps = False, -(-total_blocks // ns0)
                # prefill's default before split_d (bf16 pools: split_scores does not fit next to FP8 staging)
                split_scores = split_scores or (split_scores_default and not fp8 and t >= SPLIT_SCORES_MIN_T)
                continue
            break
        bps -= 1
    piece_bars = want_pieces if pieces_apply() else False
    if ahead and not split_d:
        raise ValueError("score_ahead overlaps split_d's score wgmma: split_d does not fit next to this split's index "
                         "rows (raise n_splits or pass idx_stream=True)")
    if piece_barriers and not piece_bars:
        why = ("not with FP8 pools" if fp8 else "not producer='cp_async' (block_k=32 takes it)"
               if producer == "cp_async" else "not with split_scores or pingpong" if split_scores or pingpong
               else "not with split_d=False" if call_args["split_d"] is False
               else "split_d does not fit next to this split's index rows (raise n_splits or pass idx_stream=True)")
        raise ValueError("piece_barriers waits for each piece of d of a bf16 ring under split_d, gathered by the "
                         f"bulk-copy producer: {why}")
    if fp8_overlap and not (fp8 and split_d):
        raise ValueError("fp8_overlap interleaves one consumer's dequantization of its half of d with its score "
                         "wgmma: FP8 pools with split_d only (split_d is off here"
                         + (": bf16 pools)" if not fp8 else ", or did not fit next to this split's index rows)"))
    if fp8_overlap and _diag in ("dequant_both", "no_dequant", "loop"):
        raise ValueError(f"fp8_overlap has its own dequantization order: not with _diag={_diag!r}")
    fp8_overlap = DEFAULT_FP8_OVERLAP and fp8 and split_d and not tiles if fp8_overlap is None else bool(fp8_overlap)
    if smem > SMEM_BUDGET and tiles and dequant_defaulted and tile_slots is None and conv_batch is None:
        # the default tile ring (64 KB of bf16 tiles + 3 staging slots) does not fit next to this split's index
        # rows (an explicit n_splits, or a cluster-capped split of a long list): the consumers convert instead, as
        # where an option needs them to (their one staging slot and one tile leave ~40 KB more)
        return sparse_attention_mosaic(**{**call_args, "fp8_dequant": "consumers"})
    if smem > SMEM_BUDGET:
        raise ValueError(f"shared memory {smem} B over {SMEM_BUDGET}: lower num_stages / block_k or raise n_splits"
                         + (f" (combine='cluster' caps n_splits at {MAX_CLUSTER}: try combine='xla')" if cluster
                            else ""))
    if combine == "auto":
        # (+1 KB of margin for Mosaic's own alignment, capped at the per-block maximum: past half of it a CTA has
        # an SM to itself either way, and a size over the maximum made the occupancy query fail -> "xla")
        occupancy = (min(smem + 1024, SMEM_BUDGET), out_dtype, _device_ordinal(q), 512 if conv else 384)
        combine = _auto_combine(bt * n_hg, ns, *occupancy)
        fewer = _fewer_splits_that_fit(bt * n_hg, ns, total_blocks, *occupancy, bk) \
            if combine != "cluster" and n_splits is None and ns > 2 else None
        if fewer is not None:   # the default split count's clusters do not fit at once: fewer splits that do,
            try:                # unless this configuration cannot take that count (its own checks say so)
                return sparse_attention_mosaic(**{**call_args, "n_splits": fewer})
            except ValueError:
                pass
    ccomb = combine == "cluster" and ns > 1

    q_in = jax.lax.bitcast_convert_type(q, jnp.float16) if f16 else q   # (f16: the kernel converts q's bits itself)
    args = [q_in.reshape(bt, n_hg, BLOCK_H, d), sinks.astype(jnp.float32).reshape(n_hg, BLOCK_H)]
    meta = []
    for s_ in flat:
        # the lists and lengths as given: the kernel clamps the lengths and turns out-of-range and past-length
        # entries into -1 itself (never read), so no XLA pass runs before it
        args += [s_.idx, s_.length] + ([s_.pool.nope, s_.pool.rope, s_.pool.scale] if fp8 else [s_.pool])
        meta.append(dict(k=s_.k, n_rows=s_.n_rows))
    if lazy_rescale and split_scores:
        raise ValueError("lazy_rescale is for the one-warpgroup softmax: not with split_scores (which keeps the "
                         "running max an integer for its exchange; on by default for bf16 pools from "
                         f"{SPLIT_SCORES_MIN_T} queries per sequence, pass split_scores=False)")
    if lazy_rescale is None:
        lazy_rescale = DEFAULT_LAZY_RESCALE["fp8" if fp8 else "bf16"]
    lazy_rescale = lazy_rescale and not split_scores
    profile = None if _profile is None else (prof_entries, str(_profile))
    kernel = _build(bt, ns, d, bk, stages, bps, meta, idx_rows, float(scale) * LOG2E, ns > 1 and not ccomb, fp8,
                    _diag, check_conv_regs(regs, conv_shared, uneven) if conv else check_regs(
                        DIRECT_REGS if direct and regs is None else regs), n_hg,
                    bool(split_scores), profile, producer == "cp_async", l2_ahead,
                    ccomb, store_wait == "read", DEFAULT_IDX_FIRST if idx_first is None else bool(idx_first),
                    pingpong, cluster_loads == "early", split_d, fp8_convert, fp8_overlap, pdq, conv,
                    conv_units if conv else None, fp8_chunk_order, n_tiles,
                    (DIRECT_BATCH if direct else DEFAULT_CONV_BATCH) if conv_batch is None else conv_batch,
                    lazy_rescale, idx_ring_steps if stream else 0, direct, direct and direct_staging == "tile",
                    direct and (DEFAULT_DIRECT_PREFETCH if direct_prefetch is None else direct_prefetch),
                    piece_bars, ahead, asym, f16, fp8_copy, asym_scorer_cols, asym_q_regs)
    o, lse = kernel(*args)            # o [BT, (ns,) G, 64, d]: the G groups of 64 are the heads in order
    if f16:                           # (bf16 bits in an f16-typed output)
        o = jax.lax.bitcast_convert_type(o, jnp.bfloat16)
    if ns > 1 and not ccomb:
        o, lse = combine_lib.combine(o.reshape(bt, ns, h, d), lse.reshape(bt, ns, h), sinks.astype(jnp.float32),
                                     out_dtype, how=combine)
    o = o.astype(out_dtype).reshape(b, t, h, d)
    lse = lse.reshape(b, t, h)
    if return_lse:
        return o, lse
    return o
