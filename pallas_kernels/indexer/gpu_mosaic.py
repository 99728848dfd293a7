"""Lightning-indexer decode scores over fp8 keys on the H200's fp8 tensor cores (Pallas, Mosaic GPU backend).

    indexer_scores_mosaic(q, weights, keys, n_visible, *, block_t=128, num_stages=4, num_splits=None,
                          pad_to_block=False) -> scores [B, S, T] f32       (the contract of reference.indexer_scores)

Why: the Triton scores kernel converts every e4m3 key to f16 in registers before its MMA; at B = 64 x 128K context
it runs at 1.8x its byte floor (131 vs 73 us, session 18), and Triton's code for fp8 operands was slower still
(204 us, session 10). Here no key byte is touched by an ALU: TMA streams each block of keys into shared memory in
the layout the tensor cores read (128 B rows, 128 B swizzle) and one wgmma e4m3 x e4m3 -> f32 takes them from there.

Exactness: q arrives fake-quantized like the keys (the model does so for an fp8 cache: `layers/indexer.py`), i.e.
q = e4m3 code x 2^e per (token, head). `gpu.quantize_q_fp8` recovers that code and scale exactly (tested bit for
bit), the scale joins the head weight (ReLU(s x) = s ReLU(x) for s > 0), and the key's power-of-two scale multiplies
the head-weighted sum. Every product of two e4m3 codes is exact in f32, so the scores equal the reference up to the
order (and the tensor cores' internal precision) of the f32 sums. A q that is not fp8-representable is rounded to
e4m3 first (vLLM's fp8 indexer q does the same); the model never passes one.

CTA = (query row r = (b, s), split of the key blocks), one warpgroup:
* q [H, 128] e4m3 and the row's head weights [H] land once (TMA); n_visible[r] is read from global memory.
* the split's visible blocks (`block_t` keys each, blocks at or past n_visible are not read) stream through a ring
  of `num_stages` slots: keys [block_t, 128] e4m3 + their f32 scales [block_t], one barrier per slot;
* per block: logits = K q^T [block_t, H] (wgmma, M = block_t, N = H, K = 128, both operands K-major in shared
  memory), ReLU, x weight, sum over H (a row reduction of the accumulator), x key scale, -inf at t >= n_visible;
  the [block_t] scores go out through a two-slot shared buffer by TMA, and the slot's refill is issued once every
  thread is past it (`commit_smem` is a warpgroup barrier);
* the split's blocks past n_visible get -inf without reading keys.
Keys are copied as [block_t, 128] boxes of the [B, T, 128] array (TMA fills rows past T with zeros; T must be a
multiple of 8, the tile's rows); the scales as a flat [B * T] array (a TMA row stride must be a multiple of 16 B,
which [B, T] f32 would need T % 4 for): a block running past T reads the next row's scales, and the mask discards
those entries.

Decode-oriented: one query per CTA, so S queries of one row read its keys S times (prefill stays on the Triton
kernel, whose programs share each key block between up to 8 queries). Hopper (sm_90a) only. On the CPU it lowers
for CUDA (tests/test_gpu_lowering.py), and `interpret=True` (or "races", with the race detector) runs it in Pallas'
GPU interpreter (simulated shared memory, barriers and TMA; jax >= 0.10) for precision="fp8": the interpreter's wgmma
takes no register operand (f16) and no transposed one (q is passed [128, H] there), and has no register layouts.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from . import formats

N_SM_H200 = 132
# splits of the key range: ~2 CTAs per SM, all resident at once (a second wave of CTAs cost 20-25%: B = 64 x 128K,
# f16, 9 splits = 576 CTAs 125.7 us, 4 splits = 256 CTAs 101.8 us; session 20), each with >= MIN_BLOCKS blocks
TARGET_CTAS = 2 * N_SM_H200
MIN_BLOCKS = 4
DEFAULT_PRECISION = "f16"
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


def mosaic_applies(q, keys) -> bool:
    """Whether the kernel takes this call: fp8 keys with head_dim 128, a key count T divisible by 8 (a tiled TMA box
    needs its array's dimension to be a multiple of the 8-row tile), at most 256 heads."""
    return (isinstance(keys, formats.QuantizedKeys) and keys.fmt == "fp8" and q.shape[-1] == 128
            and q.shape[-2] <= 256 and keys.values.ndim == 3 and keys.values.shape[1] % 8 == 0)


def default_config(R: int, T: int):
    """block_t 128 keys (16 KB of e4m3 per slot), 4 slots; splits for ~TARGET_CTAS CTAs of >= MIN_BLOCKS blocks."""
    block_t = 128 if T > 64 else 64
    nb = -(-T // block_t)
    return dict(block_t=block_t, num_stages=4,
                num_splits=max(1, min(-(-nb // MIN_BLOCKS), TARGET_CTAS // max(R, 1))))


def _kernel(nv_ref, w_ref, q_ref, key_ref, scale_ref, out_ref, q_smem, w_smem, k_smem, s_smem, o_smem, fill_smem,
            q_bar, k_bars, *, T, bt, stages, bps, nb, S, f16, interpret=False):
    """nv [R] i32, w [R, H] f32, q [R, H, 128] e4m3 (f16 codes with f16), keys [B, T, 128] e4m3, scales [B*T] f32
    -> out [R, nb*bt]."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    r = jax.lax.axis_index("r")
    split = jax.lax.axis_index("s")
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
        plgpu.copy_gmem_to_smem(scale_ref.at[pl.ds(base + t0, bt)], s_smem.at[slot], k_bars.at[slot])

    plgpu.copy_gmem_to_smem(q_ref.at[r], q_smem, q_bar)
    plgpu.copy_gmem_to_smem(w_ref.at[r], w_smem, q_bar)
    for j in range(stages):
        @pl.when(j < n_read)
        def _(j=j):
            issue(j)

    fill_smem[...] = cast(jnp.full((bt,), -jnp.inf, jnp.float32), row_layout)
    plgpu.barrier_wait(q_bar)
    w = load(w_smem, col_layout)
    # [128, H], K-major as fp8 operands must be (the interpreter's wgmma takes no transposed ref: q arrives [128, H])
    q_t = q_smem if interpret else plgpu.transpose_ref(q_smem, (1, 0))
    H = w_smem.shape[0]

    def store(j, vals_smem):   # the block's scores (a [bt] smem vector, committed) to global memory
        plgpu.copy_smem_to_gmem(vals_smem, out_ref.at[r, pl.ds(pl.multiple_of((lo + j) * bt, bt), bt)])

    def body(j, carry):
        slot = j % stages
        plgpu.barrier_wait(k_bars.at[slot])

        def mma(acc_ref):
            if f16:   # e4m3 codes -> f16 in registers (exact), the wgmma's A operand from registers
                a8 = load(k_smem.at[slot], plgpu.Layout.WGMMA_UPCAST_2X)
                plgpu.wgmma(acc_ref, cast(a8.astype(jnp.float16), plgpu.Layout.WGMMA), q_t)
            else:
                plgpu.wgmma(acc_ref, k_smem.at[slot], q_t)
            return acc_ref[...]

        logits = pl.run_scoped(mma, plgpu.ACC((bt, H), jnp.float32))
        scale = load(s_smem.at[slot], row_layout)
        s = jnp.sum(jnp.maximum(logits, 0.0) * jax.lax.broadcast_in_dim(w, (bt, H), (1,)), axis=1) * scale
        t = (lo + j) * bt + plgpu.broadcasted_iota(jnp.int32, (bt,), 0, layout=None if interpret else row_layout)
        s = jnp.where(t < nv, s, -jnp.inf)
        o = o_smem.at[j % 2]
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)   # the store that last read this output slot is done
        o[...] = s
        plgpu.commit_smem()   # also a warpgroup barrier: every thread is past this slot's keys and scales

        @pl.when(j + stages < n_read)
        def _():
            issue(j + stages)

        store(j, o)
        return carry

    jax.lax.fori_loop(0, n_read, body, 0)
    plgpu.commit_smem()

    def fill(j, carry):   # blocks of this split past n_visible: -inf, keys unread
        store(j, fill_smem)
        return carry

    jax.lax.fori_loop(n_read, hi - lo, fill, 0)
    plgpu.wait_smem_to_gmem(0)


PRECISIONS = ("f16", "fp8")


def _interpret_params(detect_races=False):
    """Pallas' GPU interpret mode (jax >= 0.10: simulated shared memory, threads, barriers and TMA on the CPU).
    Reads past an array's end return NaN (a TMA box past the end fills zeros on the GPU; NaN checks the masking)."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams(out_of_bounds_reads="uninitialized", uninitialized_memory="nan",
                              detect_races=detect_races)


def indexer_scores_mosaic(q, weights, keys, n_visible, *, block_t=None, num_stages=None, num_splits=None,
                          pad_to_block=False, precision=None, interpret=False):
    """Scores [B, S, T] f32 (or [B, S, roundup(T, block_t)] with -inf padding if pad_to_block) like
    `reference.indexer_scores`, for fp8 keys (`formats.QuantizedKeys`, fmt "fp8"); q [B, S, H, 128] (fake-quantized
    like the keys), weights [B, S, H], n_visible [B, S] int32."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from .gpu import quantize_q_fp8

    if not isinstance(keys, formats.QuantizedKeys) or keys.fmt != "fp8":
        raise ValueError("the Mosaic indexer kernel takes fp8 keys (formats.QuantizedKeys with fmt='fp8')")
    B, S, H, d = q.shape
    T = keys.values.shape[1]
    if d != 128 or keys.values.shape != (B, T, d) or keys.scale.shape != (B, T, 1):
        raise ValueError(f"expected q [B, S, H, 128] and fp8 keys values [B, T, 128] / scale [B, T, 1], got q "
                         f"{q.shape}, values {keys.values.shape}, scale {keys.scale.shape}")
    if weights.shape != (B, S, H) or n_visible.shape != (B, S):
        raise ValueError(f"weights must be [B, S, H] = {(B, S, H)} and n_visible [B, S] = {(B, S)}, got "
                         f"{weights.shape} / {n_visible.shape}")
    if H > 256:
        raise ValueError(f"at most 256 heads (one wgmma N), got {H}")
    if T % 8:
        raise ValueError(f"the Mosaic indexer kernel needs the key count T to be a multiple of 8 (TMA's 8-row tile), "
                         f"got T={T}; kernel='triton' takes any T")
    precision = precision or DEFAULT_PRECISION
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    f16 = precision == "f16"
    if interpret and f16:
        raise ValueError("the Mosaic indexer kernel's interpret mode runs precision='fp8' only (the interpreter's "
                         "wgmma takes no register operand, which precision='f16' feeds)")
    R = B * S
    cfg = default_config(R, T)
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
    n_split = -(-nb // bps)
    hp = -(-H // 32) * 32   # the weights' copy moves a multiple of 128 B; padded heads have weight 0
    qf = q.astype(jnp.float32)
    wf = weights.astype(jnp.float32)
    if hp != H:
        qf = jnp.pad(qf, ((0, 0), (0, 0), (0, hp - H), (0, 0)))
        wf = jnp.pad(wf, ((0, 0), (0, 0), (0, hp - H)))
    q8, q_scale = quantize_q_fp8(qf, "fp8")           # exact for a fake-quantized q
    wf = (wf * q_scale).reshape(R, hp)
    q8 = q8.reshape(R, hp, d)
    if f16:   # the e4m3 codes as f16 (exact): the B operand of an f16 wgmma
        q8 = q8.astype(jnp.float16)
    if interpret:
        q8 = jnp.swapaxes(q8, 1, 2)
    key_vals = keys.values
    key_scale = keys.scale.reshape(B * T).astype(jnp.float32)
    nv = n_visible.astype(jnp.int32).reshape(R)
    tile = (plgpu.TilingTransform((8, 128)), plgpu.SwizzleTransform(128))     # 128 B rows of e4m3
    q_tile = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)) if f16 else tile
    if interpret:   # the interpreter ignores shared-memory layouts (and q is transposed there)
        tile = q_tile = ()
    kernel = plgpu.kernel(
        functools.partial(_kernel, T=T, bt=bt, stages=stages, bps=bps, nb=nb, S=S, f16=f16, interpret=interpret),
        out_type=jax.ShapeDtypeStruct((R, nb * bt), jnp.float32),
        grid=(R, n_split), grid_names=("r", "s"),
        scratch_types=[
            plgpu.SMEM(q8.shape[1:], q8.dtype, transforms=q_tile),            # q_smem [H, 128] ([128, H] interpreted)
            plgpu.SMEM((hp,), jnp.float32),                                   # w_smem
            plgpu.SMEM((stages, bt, d), jnp.float8_e4m3fn, transforms=tile),  # k_smem
            plgpu.SMEM((stages, bt), jnp.float32),                            # s_smem
            plgpu.SMEM((2, bt), jnp.float32),                                 # o_smem
            plgpu.SMEM((bt,), jnp.float32),                                   # fill_smem
            plgpu.Barrier(num_arrivals=2),                                    # q_bar
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),               # k_bars
        ],
        kernel_name=f"indexer_scores_fp8_mosaic_{precision}_t{bt}",
        **(dict(interpret=_interpret_params(interpret == "races")) if interpret else {}),
    )
    out = kernel(nv, wf, q8, key_vals, key_scale).reshape(B, S, nb * bt)
    return out if pad_to_block else out[..., :T]
