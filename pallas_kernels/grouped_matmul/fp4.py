"""The grouped matmul with the checkpoint's FP4 expert weights read as they are: reference, GPU kernel, dispatcher
(the TPU kernel: `tpu.grouped_matmul_fp4_tpu`).

    grouped_matmul_fp4(lhs [M, K], rhs: Fp4Weights (packed [E, N, K/2] uint8, scales [E, N, K/32] uint8),
                       group_sizes [E] int32, *, impl="reference", **kernel_options) -> [M, N] float32

Why: with the routed experts on the grouped-matmul kernel, a batch-16 decode step of V4-Flash is bound by reading
their bf16 weights (session 46, H200: 4736.9 us a 4-layer step against a 4829.7 us read floor, 16.3 of its 18.5 GB
the experts'). The checkpoint stores them as e2m1 with an e8m0 scale per 32 inputs (spec §5.3; `dsv4_jax.quant`),
4.25 bits a weight against 16: read in place, the same step's expert bytes shrink 3.8x.

Weights (`Fp4Weights`, the checkpoint's own [E, out, in / 2] orientation: a checkpoint expert's [out, in / 2] int8
+ [out, in / 32] e8m0, stacked, `from_checkpoint`): byte [e, n, k2] holds w[e, 2 k2, n] (input 2 k2, output n) in
its low nibble and w[e, 2 k2 + 1, n] in its high one (bit 3 the sign, bits 0-2 index {0, .5, 1, 1.5, 2, 3, 4, 6});
scale byte [e, n, k32] = s gives the factor 2^(s - 127) of w[e, 32 k32 .. 32 k32 + 31, n] (255 = NaN). The logical
matrix is [E, in, out] (`Fp4Weights.shape`, `dequantize`), as the model's bf16 experts. Why this orientation: a
weight's inputs are contiguous, so the kernel's tiles (inputs x outputs, the MMA's B operand) load 4-8 bytes at a
time from shared memory, where [E, in / 2, out] bytes load one by one (`benchmarks/triton_sass.py`: 7.7 against
9.0 SASS instructions a weight for the same decode).

Contract (= `reference`): the weights dequantized exactly (every e2m1 value x 2^(s - 127) is a float32, and a bfloat16
for the scales real checkpoints hold; XLA flushes the subnormal ones, s < 3, to 0), cast to lhs's dtype, then
`reference.grouped_matmul`: the same products as the model's path that dequantizes the experts at load, so the result
differs from it only by the f32 sums' order (and, in the kernel, for a NaN scale byte: `_e8m0_product_factor`).

GPU kernel (Pallas, Triton backend), the bf16 kernel's work items (`gpu.work_items`: only groups with rows are read)
with the weights' K axis in 32-input chunks: per chunk one [block_n, 16] byte tile and one [block_n, 1] scale column
are loaded, the nibbles decoded (`decode`, `DECODES`), one chunk's product taken on the tensor cores, f32
accumulation:
  "join" (default)  inline PTX (`E2M1_PAIRS_ASM`, two `prmt` byte-table lookups for 4 bytes at a time) turns each
                    byte into the bf16 bits of its two weights, unscaled; the two halves are joined back into K order
                    ([block_n, 16, 2] -> [block_n, 32], transposed), one K=32 dot with the chunk's lhs columns as they
                    are, and the [block_m, block_n] product scaled by its columns' powers of two (exact).
  "f32"             no inline PTX: every weight decoded to f32 and scaled by integer / f32 jnp ops (`_decode`), cast,
                    two K=16 dots against the chunk's even and odd lhs columns (the wrapper reorders each 32-column
                    chunk of lhs, evens first). 1.8x slower; kept as the kernel that needs no PTX.
  "join_t"          "join" with the roles swapped: the decoded [block_n, 32] weights as the MMA's
                    first operand, lhs^T the second, the accumulator [block_n, block_m] (transposed once at the end).
                    With 4 warps Triton takes Hopper's wgmma, the weights from registers: 72 registers a thread, 5.8
                    SASS instructions a weight (its bytes loaded one at a time from shared memory). With 2 warps it
                    takes mma.sync, the decoded weights used where they are: 4.6 a weight at block_n 64 (74
                    registers, 9 programs an SM), 4.2 at block_n 128 (198 registers), against "join"'s 5.5. Timed
                    (session 48, H100): no faster, 1118-1186 us at B = 16 against 1098, 2451-2623 at B = 64
                    against 2520.
  "raw"             a timing probe (`PROBES`; wrong values): "join" with the asm replaced by one integer op a byte,
                    so the difference between the two is what the decode costs.
In the Pallas interpreter (CPU) "join" runs the asm's twin `e2m1_pairs(interpret=True)`; the asm itself is checked
bit for bit by `tests/ptx_sim.py`.

Cost (session 47, H100 80GB, V4-Flash's 256 experts, w1 + w3 + w2 of one layer, `benchmarks/moe_layout.py`, net of
dispatch; `results/README_decode.md`): B = 16 "join" 1099-1113 us against 1444.8 for the bf16-weight kernel (1.31x;
floors 408.2 and 1536.6 us), "f32" 2008; B = 64 2514.7-2519.1 against 3326.4 (1.32x). That is 2.7x the FP4 bytes'
floor: at decode a weight meets ~1 token row (B = 16 x top-6 over ~84 active experts), so nothing amortizes the
decode, and the kernel runs on instructions and their latency, not bandwidth. SASS of the main loop per weight
(`benchmarks/triton_sass.py`: compiled on a CPU machine by pip triton 3.9, indicative): "f32" 18.2 as timed (15.7
since its f32 decode widens `e2m1_bf16_bits`), "join" 5.5 (the asm's 2.75, the rest HMMA operand moves, per-chunk
scaling, loads); bf16 weights 1.9. The H100 times of session 47 fit ~684 us + 73 us per instruction a weight, but
"join_t"'s fewer instructions (4.6) did not run faster (session 48), so latency with 4 programs of 4 warps an SM
(114 registers a thread) is the larger part. Prefill (session 48, 256 experts; `MAX_BLOCK_M`): each weight is decoded
once per row tile, 5008.5 us at 512 tokens against 4833.6 with bf16 weights, 10347.5 against 6918.3 at 2048. The
model takes the kernel with `expert_weights="fp4"` (`load_pretrained(..., expert_weights="fp4")` keeps a DeepSeek
checkpoint's FP4 experts as their bytes; the default still dequantizes them to the model dtype: FP4 decodes 1.3x
faster and prefills up to 1.5x slower).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ..dispatch import resolve_impl, run_resolved
from .gpu import default_block_m, fit_block, kernel_applies, launch
from .reference import grouped_matmul as grouped_matmul_reference
from .reference import precision_for

CHUNK = 32   # inputs per e8m0 scale (the checkpoint's FP4 block)
# decode-shaped defaults: 4 chunks per K step, 128 output columns per program, decode "join". Session 47 (H100, 256
# experts, B = 16, us): block_k 128 1099-1113, 64 1113-1134, 256 1215; 3 stages 1099; block_n 256 x 8 warps 1182-1203;
# the two-dot "prmt" variant of the asm (since removed) 1228, "f32" 2008.
# block_m None: `gpu.default_block_m` capped at MAX_BLOCK_M; block_k None: 128 for 16-row tiles (decode), 64 for
# wider ones (prefill): configs the GPU has compiled and checked (block_m 64 with block_k 64 passed its GPU test in
# session 47, block_m 32 and 16 ran checked in session 48; block_m 128 is untried, and pip triton 3.9 fails to
# compile "join" at block_m 64, `benchmarks/triton_sass.py`). Session 48 (H100, 256 experts, prefill, us; the bf16
# kernel 4833.6 at B = 512 tokens, 6918.3 at 2048): block_m 64 6488.7 / 10205.2, 32 5008.5 / 10347.5, 16 5229.7 /
# 12468.3. At prefill the decode of every weight for each M tile binds (the bf16-weight kernel stays faster there).
# Decode (B = 16 / 64, us): "join" 1098.0 / 2520.4; "join_t" with 2 warps 1118.1 / 2451.4, at block_n 64 1156.3 /
# 2551.2, 4 warps 1186.2 / 2623.0: "join" stays.
DEFAULT_CONFIG = dict(block_m=None, block_n=128, block_k=None, num_warps=4, num_stages=4, decode="join")
MAX_BLOCK_M = 32


def default_block_k(block_m: int, K: int) -> int:
    """The widest of 128 (16-row tiles) or 64 (wider ones) and below, in 32-input chunks, that divides K."""
    bk = 128 if block_m <= 16 else 64
    while K % bk:
        bk -= CHUNK
    return bk


DECODES = ("join", "f32", "join_t")   # how the kernel decodes and multiplies (module doc, `_fp4_body`)
# timing probes, wrong values: "raw" is "join" with the asm replaced by one integer op a byte (what the decode costs)
PROBES = ("raw",)


class Fp4Weights(NamedTuple):
    """A stack of FP4 expert matrices in the checkpoint's layout (module doc): packed [E, N, K/2] uint8, scales
    [E, N, K/32] uint8 (e8m0), N outputs and K inputs. `shape` is the logical [E, K, N]."""
    packed: jax.Array
    scales: jax.Array

    @property
    def shape(self):
        E, N, K2 = self.packed.shape
        return (E, 2 * K2, N)


def check_weights(w: Fp4Weights):
    """-> (E, K, N); raises on shapes or dtypes that are not the layout of the module doc."""
    if not isinstance(w, Fp4Weights):
        raise TypeError(f"grouped_matmul_fp4: rhs must be Fp4Weights, got {type(w).__name__}")
    if w.packed.ndim != 3 or w.scales.ndim != 3:
        raise ValueError(f"grouped_matmul_fp4: packed [E, N, K/2] and scales [E, N, K/32], got {w.packed.shape} and "
                         f"{w.scales.shape}")
    E, K, N = w.shape
    if K % CHUNK or w.scales.shape != (E, N, K // CHUNK):
        raise ValueError(f"grouped_matmul_fp4: K = {K} must be a multiple of {CHUNK} and scales [E, N, K/{CHUNK}] = "
                         f"{(E, N, K // CHUNK)}, got {w.scales.shape}")
    if w.packed.dtype != jnp.uint8 or w.scales.dtype != jnp.uint8:
        raise ValueError(f"grouped_matmul_fp4: packed and scales must be uint8, got {w.packed.dtype} and "
                         f"{w.scales.dtype}")
    return E, K, N


def from_checkpoint(packed_experts, scale_experts) -> Fp4Weights:
    """Checkpoint experts, stacked: packed [E, out, in/2] int8 / uint8 and e8m0 scales [E, out, in/32] ->
    `Fp4Weights` (the same bytes, read as uint8; logical shape [E, in, out])."""
    p = jnp.asarray(packed_experts)
    p = jax.lax.bitcast_convert_type(p, jnp.uint8) if p.dtype == jnp.int8 else p
    return Fp4Weights(p, jnp.asarray(scale_experts, jnp.uint8))


def _e2m1(codes):
    """int32 nibble codes -> their f32 values (exact): `e2m1_bf16_bits` widened to f32 (a bf16's bits are the top
    half of the same f32's)."""
    return jax.lax.bitcast_convert_type(e2m1_bf16_bits(codes) << 16, jnp.float32)


def _e8m0(scale_bytes):
    """int32 e8m0 bytes -> the f32 factors 2^(s - 127) (2^-127 for s = 0, a subnormal; NaN for s = 255)."""
    scale = jax.lax.bitcast_convert_type(jnp.where(scale_bytes == 0, 0x00400000, scale_bytes << 23), jnp.float32)
    return jnp.where(scale_bytes == 255, jnp.nan, scale)


def _e8m0_product_factor(scale_bytes):
    """int32 e8m0 bytes -> f32 factors for the kernel's per-chunk products: 2^(s - 127) for s = 1 .. 254 (exact), 0
    for s = 0 and inf for s = 255 (NaN), one shift a factor. s = 0 agrees with the reference on the GPU, where XLA
    flushes the subnormal 2^-127 weights to 0; a NaN scale gives inf or NaN (inf x 0) in the products, not always NaN
    as in the reference: non-finite either way."""
    return jax.lax.bitcast_convert_type(scale_bytes << 23, jnp.float32)


def _decode(codes, scale_bytes):
    """int32 nibble codes [..] and int32 e8m0 bytes broadcastable to them -> f32 values (exact)."""
    return _e2m1(codes) * _e8m0(scale_bytes)


def e2m1_bf16_bits(codes):
    """int32 nibble codes -> int32 holding their values' bfloat16 bit patterns (exact, no scale): magnitude codes
    2-7 are (c << 6) + 0x3F00 (exponent 126 + e, mantissa bit m), 1 is 0x3F00 (0.5), 0 is 0; bit 3 the sign."""
    c = codes & 7
    return jnp.where(c < 2, c * 0x3F00, c * 64 + 0x3F00) | ((codes & 8) << 12)


# One byte's two nibbles -> their bfloat16 bit patterns (low nibble's in the low half, high nibble's in the high
# half), 4 bytes an instance ($4 in, $0..$3 out, byte i -> $i): two 8-entry byte tables (`prmt` looks up 4 bytes
# at once from a 2-register table, selected by the nibbles of its third operand) give each magnitude code's low
# byte L and high byte H: L = 00 00 80 C0 00 40 80 C0, H = 00 3F 3F 3F 40 40 40 40 for codes 0-7 (bf16 0, .5, 1,
# 1.5, 2, 3, 4, 6). Bytes 0 and 1 first: x's nibbles 0-3 are [lo0, hi0, lo1, hi1], masked to 3 bits (a selector's
# bit 3 would switch prmt to sign replication), so one lookup per table gives all four codes' bytes; the signs
# (nibble bit 3) go to the H bytes' bit 7 (a byte pair [b0, b0, b1, b1] shifted by 4 for the low nibbles, as is for
# the high ones); then each byte's output word is [L(lo), H(lo), L(hi), H(hi)]. Then bytes 2 and 3. 22 SASS instructions
# for 8 weights (`benchmarks/asm_sass_counts.py`); checked bit for bit by `tests/ptx_sim.py` and on the GPU.


def _pairs_asm_of_two_bytes(selectors, spread, out_lo, out_hi):
    """The asm for two of the 4 bytes: `selectors` leaves their 4 nibbles in s's low 16 bits, `spread` is the prmt
    selector of [b, b, b', b'] from $4, the two output words go to out_lo / out_hi."""
    return f"""{selectors}
and.b32 s, s, 0x7777;
prmt.b32 l, lt0, lt1, s;
prmt.b32 h, ht0, ht1, s;
prmt.b32 y, $4, $4, {spread};
shl.b32 t, y, 4;
and.b32 t, t, 0x00800080;
or.b32 h, h, t;
and.b32 t, y, 0x80008000;
or.b32 h, h, t;
prmt.b32 {out_lo}, l, h, 0x5140;
prmt.b32 {out_hi}, l, h, 0x7362;
"""


E2M1_PAIRS_ASM = ("""{
.reg .b32 lt0, lt1, ht0, ht1, s, l, h, y, t;
mov.b32 lt0, 0xC0800000;
mov.b32 lt1, 0xC0804000;
mov.b32 ht0, 0x3F3F3F00;
mov.b32 ht1, 0x40404040;
""" + _pairs_asm_of_two_bytes("mov.b32 s, $4;", "0x1100", "$0", "$1")
                  + _pairs_asm_of_two_bytes("shr.u32 s, $4, 16;", "0x3322", "$2", "$3") + "}")


def e2m1_pairs(packed, *, interpret=False):
    """uint8 bytes [..] -> int32 [..]: each byte's low nibble's bfloat16 bits | its high nibble's << 16 (the
    values unscaled, exact; int32, not uint32: Triton's verifier refuses an unsigned inline-asm result). Compiled:
    `E2M1_PAIRS_ASM` (inline PTX, 4 bytes an instance); interpreted: the same bits by `e2m1_bf16_bits`."""
    if interpret:
        p = packed.astype(jnp.int32)
        return e2m1_bf16_bits(p & 15) | (e2m1_bf16_bits(p >> 4) << 16)
    return pltriton.elementwise_inline_asm(E2M1_PAIRS_ASM, args=[packed], constraints="=r,=r,=r,=r,r", pack=4,
                                           result_shape_dtypes=[jax.ShapeDtypeStruct(packed.shape, jnp.int32)])[0]


def _bf16(bits):
    """int32 holding bfloat16 bit patterns in their low 16 bits -> bfloat16."""
    return jax.lax.bitcast_convert_type((bits & 0xFFFF).astype(jnp.uint16), jnp.bfloat16)


def dequantize(w: Fp4Weights, dtype=jnp.float32):
    """Fp4Weights -> [E, K, N] in `dtype` (exact in f32)."""
    E, K, N = check_weights(w)
    p = w.packed.astype(jnp.int32)
    codes = jnp.stack([p & 15, p >> 4], axis=-1).reshape(E, N, K)         # [E, N, K/2, 2] -> even, odd inputs
    scales = jnp.repeat(w.scales.astype(jnp.int32), CHUNK, axis=-1)
    return jnp.swapaxes(_decode(codes, scales).astype(dtype), 1, 2)


def grouped_matmul_fp4_reference(lhs, rhs: Fp4Weights, group_sizes):
    """The contract (module doc): dequantize, cast to lhs's dtype, `reference.grouped_matmul`."""
    check_weights(rhs)
    return grouped_matmul_reference(lhs, dequantize(rhs, lhs.dtype), group_sizes)


def _fp4_body(block_m, block_n, block_k, K, decode, interpret):
    """The product over K in block_k steps of 32-input chunks (module doc, `DECODES`). "join" takes lhs as it is and
    scales each chunk's [block_m, block_n] product by its columns' powers of two (the same f32 products as the
    reference, summed per chunk first); "f32" takes lhs's chunks evens-first (`evens_first`) and scales each weight."""
    half = CHUNK // 2

    def joined(p):
        """A chunk's bytes [block_n, 16] -> its weights [block_n, 32] bf16 (unscaled), inputs in K order."""
        if decode == "raw":   # the timing probe: no decode, wrong values
            pairs = p.astype(jnp.int32) * 0x00100010
        else:
            pairs = e2m1_pairs(p, interpret=interpret)                                         # [bn, 16] int32
        return jnp.stack([_bf16(pairs), _bf16(pairs >> 16)], axis=-1).reshape(block_n, CHUNK)

    def body(g, row0, col0, lhs_ref, packed_ref, scales_ref):
        dot = functools.partial(jnp.dot, precision=precision_for(lhs_ref.dtype), preferred_element_type=jnp.float32)
        rows = pl.ds(row0, block_m)

        def step(kk, acc):   # acc [block_m, block_n]; "join_t": [block_n, block_m]
            for j in range(block_k // CHUNK):                  # the K step's 32-input chunks
                c = kk * (block_k // CHUNK) + j
                p = packed_ref[g, pl.ds(col0, block_n), pl.ds(pl.multiple_of(c * half, half), half)]  # [bn, 16]
                s = scales_ref[g, pl.ds(col0, block_n), pl.ds(c, 1)].astype(jnp.int32)       # [bn, 1]
                if decode == "f32":   # even and odd inputs as two dots, every weight scaled
                    p = p.T.astype(jnp.int32)                                                  # [16, bn]
                    for a0, codes in ((c * CHUNK, p & 15), (c * CHUNK + half, p >> 4)):
                        a = lhs_ref[rows, pl.ds(pl.multiple_of(a0, half), half)]
                        acc = acc + dot(a, _decode(codes, s.T).astype(a.dtype))
                    continue
                w = joined(p).astype(lhs_ref.dtype)                                            # [bn, 32]
                a = lhs_ref[rows, pl.ds(pl.multiple_of(c * CHUNK, CHUNK), CHUNK)]              # [bm, 32]
                if decode == "join_t":   # the weights as the MMA's first operand
                    acc = acc + dot(w, a.T) * _e8m0_product_factor(s)
                else:                    # "join", "raw"
                    acc = acc + dot(a, w.T) * _e8m0_product_factor(s.T)
            return acc

        if decode == "join_t":
            return jax.lax.fori_loop(0, K // block_k, step, jnp.zeros((block_n, block_m), jnp.float32)).T
        return jax.lax.fori_loop(0, K // block_k, step, jnp.zeros((block_m, block_n), jnp.float32))

    return body


def evens_first(lhs):
    """lhs [M, K] -> each 32-column chunk reordered, its 16 even columns then its 16 odd ones (the kernel's order)."""
    M, K = lhs.shape
    return lhs.reshape(M, K // CHUNK, CHUNK // 2, 2).swapaxes(-1, -2).reshape(M, K)


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "num_warps", "num_stages",
                                             "decode", "interpret"))
def grouped_matmul_fp4_gpu(lhs, rhs: Fp4Weights, group_sizes, *, block_m=None, block_n=None, block_k=None,
                           num_warps=None, num_stages=None, decode=None, interpret=False):
    """lhs [M, K], rhs Fp4Weights [E, K, N], group_sizes [E] int32 -> [M, N] f32 (module doc). block_k: a multiple
    of 32 dividing K; block_n dividing N (defaults narrow to a divisor, `gpu.fit_block`)."""
    E, K, N = check_weights(rhs)
    M = lhs.shape[0]
    if lhs.shape != (M, K) or group_sizes.shape != (E,):
        raise ValueError(f"grouped_matmul_fp4: lhs [M, K = {K}] and group_sizes [E = {E}], got {lhs.shape} and "
                         f"{group_sizes.shape}")
    cfg = dict(DEFAULT_CONFIG)
    cfg.update({k: v for k, v in dict(block_m=block_m, block_n=block_n, block_k=block_k, num_warps=num_warps,
                                       num_stages=num_stages, decode=decode).items() if v is not None})
    if cfg["decode"] not in DECODES + PROBES:
        raise ValueError(f"grouped_matmul_fp4: decode must be one of {DECODES} (or the timing probe "
                         f"{PROBES}), got {cfg['decode']!r}")
    bm = cfg["block_m"] or min(default_block_m(M), MAX_BLOCK_M)
    bn = cfg["block_n"] if block_n is not None else fit_block(cfg["block_n"], N, "N")
    bk = cfg["block_k"] or default_block_k(bm, K)
    if bk % CHUNK or K % bk or N % bn:
        raise ValueError(f"grouped_matmul_fp4: block_k = {bk} must be a multiple of {CHUNK} dividing K = {K}, and "
                         f"block_n = {bn} must divide N = {N}")
    lhs_in = evens_first(lhs) if cfg["decode"] == "f32" else lhs
    return launch(_fp4_body(bm, bn, bk, K, cfg["decode"], interpret), lhs_in, (rhs.packed, rhs.scales),
                  group_sizes, N, block_m=bm, block_n=bn, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                  interpret=interpret, name=f"grouped_matmul_fp4_{cfg['decode']}_m{bm}_n{bn}_k{bk}")


def grouped_matmul_fp4(lhs, rhs: Fp4Weights, group_sizes, *, impl: str = "reference", **kernel_options):
    """Same contract as `grouped_matmul_fp4_reference`. impl: "reference"; "pallas" (GPU: the kernel; TPU:
    `tpu.grouped_matmul_fp4_tpu`, K a multiple of 256 and N of 128; CPU: the GPU kernel in the Pallas interpreter;
    "interpret_tpu": the TPU one there); "auto" (the kernel on the GPU where N is a multiple of 16, on the TPU where
    `tpu.fp4_kernel_applies`, the reference elsewhere, including the CPU). kernel_options: GPU block_m, block_n,
    block_k, num_warps, num_stages, decode; TPU block_m, block_n."""
    from . import tpu as _tpu

    where = resolve_impl(impl, "grouped_matmul_fp4", extra=("interpret_tpu",))
    E, K, N = check_weights(rhs)
    return run_resolved(where, impl, "grouped_matmul_fp4", kernel_options,
                        applies=lambda w: (kernel_applies if w == "gpu" else _tpu.fp4_kernel_applies)(K, N),
                        reference=lambda: grouped_matmul_fp4_reference(lhs, rhs, group_sizes),
                        gpu=lambda **kw: grouped_matmul_fp4_gpu(lhs, rhs, group_sizes, **kw),
                        tpu=lambda **kw: _tpu.grouped_matmul_fp4_tpu(lhs, rhs, group_sizes, **kw))
