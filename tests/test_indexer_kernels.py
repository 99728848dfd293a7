"""Indexer scores + top-k kernels vs `indexer_topk` / `indexer_scores` (the jnp reference), on CPU: the GPU (Triton)
kernel in the Pallas interpreter (impl="pallas" on CPU) and the TPU (Mosaic) kernel in the TPU interpreter
(impl="interpret_tpu"). Tiny shapes, fresh random inputs, ragged / zero / over-long n_visible, every key format.
The `test_gpu_*` tests run the compiled kernel and skip without a GPU."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.indexer import (formats as F, indexer_scores, indexer_scores_pallas, indexer_topk,
                                    indexer_topk_reference, resolve_impl)
from pallas_kernels.indexer.gpu import topk_from_scores
from pallas_kernels.indexer.topk import as_index_set
from tiers import core, full, full_tier, sweep

_SEED = itertools.count(9000)
ON_GPU = jax.default_backend() == "gpu"
INTERP = ["pallas", "interpret_tpu"]


def make(B, S, H, T, fmt, rotate=False, causal=False, d=128):
    rng = np.random.default_rng(next(_SEED))
    q = jnp.asarray(rng.standard_normal((B, S, H, d)), jnp.float32)
    keys = jnp.asarray(rng.standard_normal((B, T, d)) * 2.0, jnp.float32)
    if rotate:
        q, keys = F.hadamard(q), F.hadamard(keys)
    if fmt in ("fp8", "fp4"):
        q = F.fake_quantize(q, fmt)
    w = jnp.asarray(rng.standard_normal((B, S, H)), jnp.float32) * (H ** -0.5 * d ** -0.5)
    if causal:  # prefill-like: query s of row b sees floor((p_b + s + 1) / 4) entries
        p = rng.integers(0, 4 * T - S, (B, 1))
        nv = (p + np.arange(S)[None, :] + 1) // 4
    else:       # ragged, including 0 and > T
        nv = rng.integers(0, T + 3, (B, S))
        nv.flat[0] = 0
        nv.flat[-1] = T + 5
    return q, w, F.quantize(keys, fmt), jnp.asarray(nv, jnp.int32)


def check_picks(picks, q, w, keys, nv, k, exact=True, tol=1e-4, rows_per=128):
    """picks == reference picks, or (near-ties) the same reference scores in the same order and the same -1s: each
    picked entry's reference score within `tol` x the row's largest |score| of the reference pick's. The reference
    runs `rows_per` rows at a time: its f32 scores and dequantized keys take 9 GiB at 384 x 32768 in one piece
    (session 63: such cases ran out of GPU memory beside other pytest workers, results/h100_s63r1_tests5.log)."""
    B = q.shape[0]
    if B > rows_per:
        for i in range(0, B, rows_per):
            r = slice(i, min(i + rows_per, B))
            check_picks(picks[r], q[r], w[r], jax.tree.map(lambda x: x[r], keys), nv[r], k, exact, tol, rows_per)
        return
    ref = indexer_topk_reference(q, w, keys, nv, k=k)
    picks, ref = np.asarray(picks), np.asarray(ref)
    assert picks.shape == ref.shape and picks.dtype == np.int32
    np.testing.assert_array_equal(picks < 0, ref < 0)
    if exact and np.array_equal(picks, ref):
        return
    s = np.asarray(indexer_scores(q, w, keys, nv))
    sp = np.take_along_axis(s, np.maximum(picks, 0), -1)
    sr = np.take_along_axis(s, np.maximum(ref, 0), -1)
    m = ref >= 0
    # near-ties may swap: the picked entries' reference scores agree to the kernel's rounding, measured against
    # the row's score scale (scores near 0 have no useful relative precision)
    fin = np.where(np.isfinite(s), np.abs(s), 0.0)
    row_scale = np.broadcast_to(fin.max(axis=-1, keepdims=True), sp.shape)
    np.testing.assert_array_less(np.abs(sp[m] - sr[m]), tol * row_scale[m] + 1e-7)


def check_scores(q, w, keys, nv, impl, tol, **opts):
    out = np.asarray(indexer_scores_pallas(q, w, keys, nv, impl=impl, **opts))
    ref = np.asarray(indexer_scores(q, w, keys, nv))
    np.testing.assert_array_equal(np.isfinite(out), np.isfinite(ref))
    fin = np.isfinite(ref)
    if fin.any():
        err = np.linalg.norm(out[fin] - ref[fin]) / np.linalg.norm(ref[fin])
        assert err <= tol, err


# the default tier: every key format on the GPU kernel's interpreter, the quantized ones on the TPU kernel's
@pytest.mark.parametrize("impl,fmt,rotate", [(i, f, r) if (i == "pallas" and (f, r) != ("fp4", False))
                                             or (f in ("fp8", "fp4") and r) else full(i, f, r)
                                             for i in INTERP for f, r in [(None, False), ("bf16", False),
                                                                          ("fp8", True), ("fp4", True),
                                                                          ("fp4", False)]])
def test_decode_all_formats(impl, fmt, rotate):
    """decode: one query per row against its whole key cache; T not a multiple of the key block."""
    q, w, keys, nv = make(3, 1, 64, 300, fmt, rotate)
    check_scores(q, w, keys, nv, impl, 1e-5)
    check_picks(indexer_topk(q, w, keys, nv, k=32, impl=impl), q, w, keys, nv, 32)


@pytest.mark.parametrize("impl", INTERP)
def test_prefill_chunked_causal(impl):
    """prefill: 19 queries in chunks of 8 (padding of the last chunk), causal n_visible, fp8 keys, k > visible."""
    q, w, keys, nv = make(2, 19, 64, 40, "fp8", True, causal=True)
    check_picks(indexer_topk(q, w, keys, nv, k=24, query_chunk=8, impl=impl), q, w, keys, nv, 24)


@pytest.mark.parametrize("fmt", ["fp8", full("bf16"), full("fp4")])
def test_tpu_kernel_skips_unseen_key_blocks(fmt):
    """The TPU kernel (interpreted) on caches filled to a part of their capacity: key blocks past the last one a
    query block sees keep that block's index (no copy) and are written -inf without compute. Rows seeing 0, part of
    a block, several blocks, all of them; queries of one block seeing different lengths; == the reference."""
    q, w, keys, nv = make(3, 3, 16, 2300, fmt, rotate=fmt != "bf16")
    nv = jnp.asarray([[0, 700, 1500], [2300, 5, 512], [0, 0, 0]], jnp.int32)
    check_scores(q, w, keys, nv, "interpret_tpu", 1e-5)
    check_picks(indexer_topk(q, w, keys, nv, k=32, impl="interpret_tpu"), q, w, keys, nv, 32)


def test_tpu_kernel_prepares_fp4_q_itself():
    """fp4 keys on the TPU kernel (default precision): the kernel fake-quantizes q itself, once a query block
    (`tpu._prepare_fp4_q`: masked lane maxima, e2m1 rounding by bits, even / odd channels by 0/1 matmuls), so the
    dispatcher passes the model's raw q through (`tpu.takes_raw_q`). The preparation equals `formats.fake_quantize`
    bit for bit -- zero, sub-floor, huge and mixed-magnitude groups, values on e2m1's rounding ties -- and is
    idempotent; a raw q (quantize_q=True) and a fake-quantized one give the reference's scores and picks, in query
    chunks too (padding of the last)."""
    from pallas_kernels.indexer import tpu as T

    rng = np.random.default_rng(next(_SEED))
    q = rng.standard_normal((48, 128)).astype(np.float32) * np.exp2(rng.integers(-30, 30, (48, 1)))
    q[0, :32] = 0.0                                         # an all-zero group
    q[1, 32:64] *= np.float32(1e-38)                        # below the amax floor
    q[2, 64:] = np.float32(1e37) * np.sign(q[2, 64:])       # huge (a code past f32's range is inf either way)
    q[3] = rng.choice([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0], 128) * 2.0 ** 7  # e2m1 ties x 2^e
    q[3, 0] = 6.0 * 2.0 ** 7                                # ... under a group amax that fixes e
    q[4, ::2] *= np.float32(2.0 ** -20)                     # two magnitudes in every group
    q[5, 5] = -0.0
    fq = np.asarray(F.fake_quantize(jnp.asarray(q), "fp4"))
    prep = jax.jit(T._prepare_fp4_q)
    for x in (q, fq):                                       # raw, and already quantized (idempotent)
        even, odd = (np.asarray(a, np.float32) for a in prep(jnp.asarray(x)))
        np.testing.assert_array_equal(even, fq[:, 0::2])
        np.testing.assert_array_equal(odd, fq[:, 1::2])

    assert T.takes_raw_q(F.quantize(jnp.zeros((1, 8, 128)), "fp4"), {})
    assert not T.takes_raw_q(F.quantize(jnp.zeros((1, 8, 128)), "fp4"), dict(precision="f32"))
    assert not T.takes_raw_q(F.quantize(jnp.zeros((1, 8, 128)), "fp8"), {})

    B, S, H, Tk = 2, 19, 16, 300
    raw = jnp.asarray(rng.standard_normal((B, S, H, 128)), jnp.float32)
    _, w, keys, nv = make(B, S, H, Tk, "fp4")
    fq = F.fake_quantize(raw, "fp4")
    ref = np.asarray(indexer_scores(fq, w, keys, nv))
    for x, quantize in ((raw, True), (fq, False), (fq, True)):
        got = np.asarray(indexer_scores_pallas(x, w, keys, nv, impl="interpret_tpu", quantize_q=quantize))
        np.testing.assert_array_equal(np.isfinite(got), np.isfinite(ref))
        fin = np.isfinite(ref)       # f32 sums in another order: the norm-wise error of check_scores
        assert np.linalg.norm(got[fin] - ref[fin]) <= 1e-6 * np.linalg.norm(ref[fin])
    picks = indexer_topk(raw, w, keys, nv, k=24, query_chunk=8, impl="interpret_tpu", quantize_q=True)
    check_picks(picks, fq, w, keys, nv, 24)


@pytest.mark.parametrize("fmt", ["bf16", full("fp4")])
def test_decode_wide_default_blocks(fmt):
    """T >= 2048 decode takes the 256-key x 8-warp default: ragged visible lengths, one row ending mid-block."""
    q, w, keys, nv = make(2, 1, 16, 2300, fmt, rotate=fmt == "fp4")
    nv = nv.at[1, 0].set(1337)
    check_scores(q, w, keys, nv, "pallas", 1e-5, num_splits=4)


@pytest.mark.parametrize("impl", ["reference", "pallas", "interpret_tpu"])
def test_picks_as_index_set(impl):
    """picks="set": the reference's picks in ascending index order with the -1s last, on every path (the kernel
    paths through topk="threshold_set", or any other topk option followed by the set conversion)."""
    q, w, keys, nv = make(3, 2, 16, 700, "bf16")
    ref = np.asarray(indexer_topk_reference(q, w, keys, nv, k=40))
    big = np.iinfo(np.int32).max
    want = np.sort(np.where(ref < 0, big, ref), axis=-1)
    want = np.where(want == big, -1, want)
    assert not np.array_equal(want, ref)                                    # the order does change
    np.testing.assert_array_equal(np.asarray(indexer_topk(q, w, keys, nv, k=40, impl=impl, picks="set")), want)
    if impl == "pallas":
        got = indexer_topk(q, w, keys, nv, k=40, impl=impl, picks="set", topk="lax")
        np.testing.assert_array_equal(np.asarray(got), want)
    with pytest.raises(ValueError, match="picks"):
        indexer_topk(q, w, keys, nv, k=40, impl=impl, picks="best")


@full_tier
@pytest.mark.parametrize("fmt,block_t", [("bf16", 64)])
def test_decode_fused_group_maxima(fmt, block_t):
    """Decode over a power-of-two key cache: the scores kernel also writes the threshold top-k's strided-group maxima,
    one partial set per program (2 phases per program at block_t 64); their max equals the XLA maxima of its
    scores, and the pipeline's picks equal the reference's. No maxima where the partials would not be under half
    the row. (fp8 keys with 16 phases: the CUDA lowering test.)"""
    from pallas_kernels.indexer.gpu import indexer_scores_gpu
    from pallas_kernels.indexer.topk import _ordered_i32, _strided_group_max, threshold_layout

    q, w, keys, nv = make(3, 1, 16, 2048, fmt, rotate=fmt == "fp8")
    k = 64
    opts = dict(interpret=True, pad_to_block=True, group_max_k=k, block_t=block_t)
    scores, gmax = indexer_scores_gpu(q, w, keys, nv, num_splits=4, **opts)
    assert gmax is not None and gmax.shape == (3, 1, 4, 128) and gmax.dtype == jnp.int32
    ref = _strided_group_max(_ordered_i32(scores.reshape(3, -1)), threshold_layout(2048, k)[0])
    np.testing.assert_array_equal(np.asarray(jnp.max(gmax, axis=2)).reshape(3, -1), np.asarray(ref))
    for topk in ("threshold", "threshold_set"):
        picks = indexer_topk(q, w, keys, nv, k=k, impl="pallas", topk=topk, block_t=block_t, num_splits=4,
                             fuse_group_max=True)
        if topk == "threshold_set":  # the set mode's order: ascending index, -1s last
            ref_picks = indexer_topk_reference(q, w, keys, nv, k=k)
            big = np.iinfo(np.int32).max
            ref_set = np.sort(np.where(np.asarray(ref_picks) < 0, big, np.asarray(ref_picks)), axis=-1)
            np.testing.assert_array_equal(np.asarray(picks), np.where(ref_set == big, -1, ref_set))
        else:
            check_picks(picks, q, w, keys, nv, k)
    assert indexer_scores_gpu(q, w, keys, nv, num_splits=32, **opts)[1] is None


# fp4 with bf16 operands (the nibble decode to bf16, both scale broadcasts): no longer the default (f16 is), still
# an option
@pytest.mark.parametrize("fmt,opts", sweep([
    ("fp4", dict(fp4_scale="reshape", block_t=16, num_splits=3, precision="bf16")),
    ("fp4", dict(fp4_scale="gather", block_t=32, num_splits=2, precision="bf16")),
    ("fp8", dict(block_t=16, num_splits=5)), core("bf16", dict(block_t=32, waves=1)),
    ("bf16", dict(block_t=32, heads_major=True, num_splits=2)),
    ("fp4", dict(block_t=16, heads_major=True, precision="f16")),
    ("fp4", dict(block_t=16, num_splits=3, fp4_scale_at="result")),
    ("fp4", dict(block_t=16, heads_major=True, fp4_scale_at="operand")),
    ("fp4", dict(block_t=16, num_splits=3, precision="fp8")),
    ("fp8", dict(block_t=32, num_splits=2, precision="fp8"))]))
def test_split_sweep_options(fmt, opts):
    """Several key blocks per split (the pipelined sweep), splits that end past the last visible block (the -inf
    fill loop), both fp4 scale-broadcast variants; decode and causal prefill."""
    q, w, keys, nv = make(2, 1, 16, 120, fmt, rotate=fmt != "bf16")
    nv = nv.at[1, 0].set(37)
    check_scores(q, w, keys, nv, "pallas", 1e-5, **opts)
    q, w, keys, nv = make(1, 9, 16, 120, fmt, rotate=fmt != "bf16", causal=True)
    check_scores(q, w, keys, nv, "pallas", 1e-5, **opts)


@full_tier
def test_fp4_scales_on_operands_wide_group_range():
    """fp4_scale_at="operand": each 32-channel group's scale goes onto its f16 operands relative to the key's largest
    group scale. Keys whose groups span 2^-30 .. 2^12 (scale bytes far apart, some groups all zero) still match the
    reference's scores within f32 rounding of each row's scale; the decode and prefill paths both."""
    rng = np.random.default_rng(next(_SEED))
    for S, causal in ((1, False), (7, True)):
        q, w, _, nv = make(2, S, 16, 90, "fp4", rotate=True, causal=causal)
        keys = rng.standard_normal((2, 90, 128)).astype(np.float32)
        group_gain = 2.0 ** rng.integers(-30, 13, (2, 90, 4)).astype(np.float32)
        group_gain[0, :5, 1] = 0.0                                    # all-zero groups (scale byte 0)
        keys = keys * np.repeat(group_gain, 32, axis=-1)
        keys = F.quantize(jnp.asarray(keys), "fp4")
        out = np.asarray(indexer_scores_pallas(q, w, keys, nv, impl="pallas", fp4_scale_at="operand"))
        ref = np.asarray(indexer_scores(q, w, keys, nv))
        np.testing.assert_array_equal(np.isfinite(out), np.isfinite(ref))
        # per score, against a bound on its own magnitude: sum_h |w_h| |q_h| |k_t| (keys span 2^42 within a block)
        kf = np.asarray(F.dequantize(keys))
        bound = np.einsum("bsh,bt->bst", np.abs(np.asarray(w)) * np.linalg.norm(np.asarray(q), axis=-1),
                          np.linalg.norm(kf, axis=-1))
        fin = np.isfinite(ref)
        np.testing.assert_array_less(np.abs(out[fin] - ref[fin]), 1e-5 * bound[fin] + 1e-30)


@full_tier
def test_fp4_scale_at_errors():
    from pallas_kernels.indexer.gpu import indexer_scores_gpu

    q, w, keys, nv = make(1, 1, 16, 40, "fp4", rotate=True)
    with pytest.raises(ValueError, match="fp4_scale_at must be one of"):
        indexer_scores_gpu(q, w, keys, nv, interpret=True, fp4_scale_at="keys")
    with pytest.raises(ValueError, match="fp4_scale_at='operand' applies to fp4 keys with precision='f16'"):
        indexer_scores_gpu(q, w, keys, nv, interpret=True, fp4_scale_at="operand", precision="bf16")
    q8, w8, keys8, nv8 = make(1, 1, 16, 40, "fp8")
    with pytest.raises(ValueError, match="fp4_scale_at='operand' applies"):
        indexer_scores_gpu(q8, w8, keys8, nv8, interpret=True, fp4_scale_at="operand")


def test_topk_larger_than_cache_and_blockwise():
    """k > T (result width min(k, T)); blockwise top-k merges per-block survivors with the same tie order."""
    q, w, keys, nv = make(2, 2, 16, 40, "bf16")
    check_picks(indexer_topk(q, w, keys, nv, k=64, impl="pallas"), q, w, keys, nv, 64)
    rng = np.random.default_rng(next(_SEED))
    s = rng.integers(-20, 20, (3, 5, 1000)).astype(np.float32)       # many ties
    s[0, 0, 7:] = -np.inf
    s = jnp.asarray(s)
    a = topk_from_scores(s, 50, topk="blockwise", topk_block=128)
    b = topk_from_scores(s, 50, topk="lax")
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@full_tier
def test_precision_options():
    """bf16 keys with float queries: default bf16x2 is ~1e-5 accurate; plain bf16 operands ~1e-3; fp8 keys through
    f16 operands are exact (fp4 keys take f16 operands by default: every default-path test covers them)."""
    q, w, keys, nv = make(2, 3, 64, 130, "bf16")
    check_scores(q, w, keys, nv, "pallas", 1e-4)
    check_scores(q, w, keys, nv, "pallas", 1e-2, precision="bf16")
    q, w, keys, nv = make(2, 3, 16, 130, "fp8", rotate=True)          # fp8 keys through f16 operands: exact
    check_scores(q, w, keys, nv, "pallas", 1e-5, precision="f16")
    with pytest.raises(ValueError, match="f16"):
        indexer_scores_pallas(*make(1, 1, 16, 40, "bf16"), precision="f16")
    with pytest.raises(ValueError, match="fp8"):
        indexer_scores_pallas(*make(1, 1, 16, 40, "bf16"), precision="fp8")
    with pytest.raises(ValueError, match="unknown precision"):
        indexer_scores_pallas(*make(1, 1, 16, 40, "bf16"), precision="tf32")


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
@full_tier
def test_fp8_operands_exact(fmt):
    """precision="fp8": the key codes go to the tensor cores as fp8 (fp4 nibbles moved to e5m2 by bit arithmetic,
    checked here for all 256 bytes) and a q fake-quantized like the keys is reproduced exactly by its fp8 operand
    times the scale folded into the weights, so the scores equal the reference up to f32 summation order."""
    from pallas_kernels.indexer.gpu import e2m1_value, fp4_to_e5m2_scaled, quantize_q_fp8

    byte = jnp.arange(256, dtype=jnp.int32)[None, :]
    got = np.asarray(fp4_to_e5m2_scaled(byte).astype(jnp.float32))[0]
    want = np.stack([np.asarray(e2m1_value(byte[0] & 15)), np.asarray(e2m1_value(byte[0] >> 4))], -1).reshape(-1)
    np.testing.assert_array_equal(got, want * 2.0 ** -14)
    q, w, keys, nv = make(2, 3, 64, 130, fmt, rotate=True)
    q8, s = quantize_q_fp8(q, fmt)
    np.testing.assert_array_equal(np.asarray(q8.astype(jnp.float32) * s[..., None]), np.asarray(q))
    check_scores(q, w, keys, nv, "pallas", 1e-6, precision="fp8", block_t=32)
    q, w, keys, nv = make(1, 9, 16, 120, fmt, rotate=True, causal=True)
    check_scores(q, w, keys, nv, "pallas", 1e-6, precision="fp8", block_t=16, num_splits=2)


def test_dispatch():
    assert resolve_impl("reference") == "reference"
    assert resolve_impl("auto") == ("gpu" if ON_GPU else "tpu" if jax.default_backend() == "tpu" else "reference")
    with pytest.raises(ValueError):
        resolve_impl("cuda")


# ---- compiled kernel on a real GPU ---------------------------------------------------------------------------

gpu = pytest.mark.skipif(not ON_GPU, reason="needs a GPU (compiled Triton Pallas kernel)")


@gpu
@pytest.mark.parametrize("fmt,rotate", [(None, False), ("bf16", False), ("fp8", True), ("fp4", True)])
@pytest.mark.parametrize("B,S,T,k,causal", [(4, 1, 5000, 512, False), (1, 1, 70000, 1024, False),
                                            (2, 300, 700, 512, True)])
def test_gpu_kernel(fmt, rotate, B, S, T, k, causal):
    q, w, keys, nv = make(B, S, 64, T, fmt, rotate, causal=causal)
    check_scores(q, w, keys, nv, "pallas", 1e-4)
    check_picks(indexer_topk(q, w, keys, nv, k=k, impl="pallas"), q, w, keys, nv, k)
    check_picks(indexer_topk(q, w, keys, nv, k=k, impl="pallas", topk="blockwise"), q, w, keys, nv, k)


@gpu
@pytest.mark.parametrize("precision", ["f16", "fp8"])
@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
@pytest.mark.parametrize("B,S,T,causal", [(4, 1, 5000, False), (2, 300, 700, True)])
def test_gpu_f16_operands(fmt, B, S, T, causal, precision):
    """f16 and fp8 tensor-core operands for fp8 / fp4 keys (fp8: fp4 via e5m2 bit moves, fp8 keys as e4m3)."""
    q, w, keys, nv = make(B, S, 64, T, fmt, True, causal=causal)
    check_scores(q, w, keys, nv, "pallas", 1e-4, precision=precision)
    check_picks(indexer_topk(q, w, keys, nv, k=512, impl="pallas", precision=precision), q, w, keys, nv, 512)


@gpu
@pytest.mark.parametrize("B,S,T,causal,opts", [(4, 1, 5000, False, {}), (2, 300, 700, True, {}),
                                               (3, 1, 9000, False, dict(heads_major=True, block_t=64))])
def test_gpu_fp4_asm_decode(B, S, T, causal, opts):
    """fp4_decode="asm" (packed inline PTX nibble decode) gives the integer route's scores bit for bit (both decode
    exactly to e2m1 x 2^-14 in f16) and the reference's within tolerance; the picks match."""
    from pallas_kernels.indexer.gpu import indexer_scores_gpu

    q, w, keys, nv = make(B, S, 64, T, "fp4", True, causal=causal)
    asm = indexer_scores_gpu(q, w, keys, nv, fp4_decode="asm", **opts)
    alu = indexer_scores_gpu(q, w, keys, nv, fp4_decode="alu", **opts)
    np.testing.assert_array_equal(np.asarray(asm), np.asarray(alu))
    check_scores(q, w, keys, nv, "pallas", 1e-4, fp4_decode="asm", **opts)
    check_picks(indexer_topk(q, w, keys, nv, k=512, impl="pallas", fp4_decode="asm"), q, w, keys, nv, 512)


@gpu
@pytest.mark.parametrize("B,S,T,causal,opts", [(4, 1, 5000, False, {}), (2, 300, 700, True, {}),
                                               (3, 1, 9000, False, dict(heads_major=True, block_t=64)),
                                               (4, 1, 5000, False, dict(fp4_decode="alu"))])
@pytest.mark.parametrize("at", ["operand", "result"])
def test_gpu_fp4_scale_placements(B, S, T, causal, opts, at):
    """fp4_scale_at: "operand" (the default: group scales on the f16 key operands, the key's largest on its score)
    and "result" (each group's scale on its logits): the reference's scores within tolerance and its picks, with the
    asm (default) and the integer decode."""
    q, w, keys, nv = make(B, S, 64, T, "fp4", True, causal=causal)
    check_scores(q, w, keys, nv, "pallas", 1e-4, fp4_scale_at=at, **opts)
    check_picks(indexer_topk(q, w, keys, nv, k=512, impl="pallas", fp4_scale_at=at, **opts),
                q, w, keys, nv, 512)


@gpu
@pytest.mark.parametrize("B,S,H,T,opts", [(4, 1, 64, 5000, {}), (2, 2, 64, 70000, {}), (3, 1, 16, 776, {}),
                                          (2, 1, 128, 296, {}), (3, 1, 64, 4104, dict(block_t=64, num_stages=2)),
                                          (2, 1, 64, 9000, dict(block_t=256, num_splits=3)),
                                          (5, 1, 40, 2000, dict(num_splits=1, num_stages=1)),
                                          (4, 1, 64, 5000, dict(precision="fp8")),
                                          (3, 1, 16, 776, dict(precision="fp8", block_t=64)),
                                          (4, 1, 64, 5000, dict(convert="alu")), (2, 2, 64, 70000, dict(convert="mix")),
                                          (3, 1, 64, 4104, dict(block_t=64, num_stages=2, convert="alu")),
                                          (3, 1, 16, 776, dict(convert="mix")),
                                          (2, 2, 64, 70000, dict(split_m=True)), (3, 1, 16, 776, dict(split_m=True)),
                                          (4, 1, 64, 5000, dict(split_m=True, precision="fp8"))])
def test_gpu_mosaic_fp8_scores(B, S, H, T, opts):
    """The Mosaic GPU kernel over fp8 keys: scores and picks against the reference; ragged n_visible (0, inside,
    past T), heads padded to 32, odd splits, 1-8 slots. precision "f16" (the default: e4m3 codes to f16 in registers,
    f32 accumulation) agrees to f32 rounding; "fp8" (the codes straight from shared memory into an e4m3 wgmma) to
    the fp8 tensor cores' accumulation, ~1.3e-4 relative on the H200 (session 20). convert "alu" / "mix" (the
    codes placed as f16 bits by integer ops, alone or sharing the work with the conversion instruction, session 30)
    give the same exact products."""
    q, w, keys, nv = make(B, S, H, T, "fp8", True)
    fp8 = opts.get("precision") == "fp8"
    check_scores(q, w, keys, nv, "pallas", 5e-4 if fp8 else 1e-5, kernel="mosaic", **opts)
    out = np.asarray(indexer_scores_pallas(q, w, keys, nv, impl="pallas", kernel="mosaic", pad_to_block=True, **opts))
    assert out.shape[-1] % opts.get("block_t", 128) == 0 and np.all(out[..., T:] == -np.inf)
    picks = indexer_topk(q, w, keys, nv, k=512, impl="pallas", kernel="mosaic", **opts)
    check_picks(picks, q, w, keys, nv, 512, tol=1e-3 if fp8 else 1e-4)
    # the sort-free set top-k over the same scores: the same entries
    got = indexer_topk(q, w, keys, nv, k=512, impl="pallas", kernel="mosaic", picks="set", **opts)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(as_index_set(picks)))


@gpu
@pytest.mark.parametrize("B,S,H,T,opts", [(4, 1, 64, 5000, {}), (2, 2, 64, 70000, {}), (3, 1, 16, 776, {}),
                                          (2, 1, 128, 296, {}), (3, 1, 64, 4104, dict(block_t=64, num_stages=2)),
                                          (2, 1, 64, 9000, dict(block_t=256, num_splits=3)),
                                          (5, 1, 40, 2000, dict(num_splits=1, num_stages=1)),
                                          (4, 1, 64, 5000, dict(split_m=True)), (3, 1, 64, 3000, dict(block_t=192))])
def test_gpu_mosaic_fp4_scores(B, S, H, T, opts):
    """The Mosaic GPU kernel over fp4 keys (session 31): scores, picks and the set picks against the reference;
    ragged n_visible (0, inside, past T), heads padded to 32, odd splits, 1-4 slots, 64- to 256-key blocks, split_m
    off (the fp4 default) and on. Precision "f16" (the default until session 46): the f16 operands are exact
    (`mosaic_fp4`), so the scores agree to f32 rounding."""
    q, w, keys, nv = make(B, S, H, T, "fp4", True)
    opts = dict(opts, precision="f16")
    check_scores(q, w, keys, nv, "pallas", 1e-5, kernel="mosaic", **opts)
    out = np.asarray(indexer_scores_pallas(q, w, keys, nv, impl="pallas", kernel="mosaic", pad_to_block=True, **opts))
    assert out.shape[-1] % opts.get("block_t", 128) == 0 and np.all(out[..., T:] == -np.inf)
    picks = indexer_topk(q, w, keys, nv, k=512, impl="pallas", kernel="mosaic", **opts)
    check_picks(picks, q, w, keys, nv, 512)
    got = indexer_topk(q, w, keys, nv, k=512, impl="pallas", kernel="mosaic", picks="set", **opts)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(as_index_set(picks)))


@gpu
@pytest.mark.parametrize("B,S,H,T,opts", [(4, 1, 64, 5000, {}), (2, 2, 64, 70000, {}), (3, 1, 16, 776, {}),
                                          (2, 1, 128, 296, {}), (3, 1, 64, 4104, dict(block_t=64, num_stages=2)),
                                          (2, 1, 64, 9000, dict(block_t=256, num_splits=3)),
                                          (4, 1, 64, 5000, dict(split_m=True)), (3, 1, 64, 3000, dict(block_t=192))])
def test_gpu_mosaic_fp4_fp8_precision(B, S, H, T, opts, monkeypatch):
    """fp4 keys at precision "fp8" (session 45; passed on an H100 in session 46, their default since): e5m2 operands (exact: table
    lookups per key group, q's e5m2 codes), one e5m2 x e5m2 wgmma K-step per 32-channel scale group. Scores to the
    fp8 tensor cores' internal accumulation (within 1e-4 of the row scale), the picks checked against the reference
    within that tolerance, the set picks equal to them; a raw q gives the fake-quantized q's scores (the operand
    starts with q's fp4 fake quantization), and both q preparations (one Triton kernel, or jnp) give the same scores
    bit for bit."""
    q, w, keys, nv = make(B, S, H, T, "fp4", True)
    opts = dict(opts, precision="fp8")
    check_scores(q, w, keys, nv, "pallas", 1e-4, kernel="mosaic", **opts)
    picks = indexer_topk(q, w, keys, nv, k=512, impl="pallas", kernel="mosaic", **opts)
    check_picks(picks, q, w, keys, nv, 512, tol=1e-4)
    got = indexer_topk(q, w, keys, nv, k=512, impl="pallas", kernel="mosaic", picks="set", **opts)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(as_index_set(picks)))
    from pallas_kernels.indexer.gpu_mosaic import indexer_scores_mosaic

    raw = jnp.asarray(np.random.default_rng(B * T).standard_normal(q.shape), jnp.float32)
    base = np.asarray(indexer_scores_mosaic(raw, w, keys, nv, **opts))
    np.testing.assert_array_equal(base, np.asarray(indexer_scores_mosaic(F.fake_quantize(raw, "fp4"), w, keys, nv,
                                                                         **opts)))
    from pallas_kernels.indexer import gpu_mosaic

    monkeypatch.setitem(gpu_mosaic.MOSAIC_CONFIG, "q_prep", "xla")
    np.testing.assert_array_equal(base, np.asarray(indexer_scores_mosaic(raw, w, keys, nv, **opts)))


_CONVERTER_SHAPES = [(4, 1, 64, 5000, {}), (2, 2, 64, 70000, {}), (3, 1, 16, 776, {}), (2, 1, 128, 296, {}),
                     (3, 1, 64, 4104, dict(block_t=64, num_stages=2)), (2, 1, 64, 9000, dict(block_t=256, num_splits=3)),
                     (5, 1, 40, 2000, dict(num_splits=1, num_stages=1)), (64, 1, 64, 32768, {})]


@gpu   # fp4_tables "shared" and fp4_layout "rows" want a block_t that is a multiple of 128
@pytest.mark.parametrize("B,S,H,T,opts,slots,tables", [
    shape + (slots, tables) for shape in _CONVERTER_SHAPES
    for slots, tables in [(1, "registers"), (2, "registers"), (2, "shared"), (1, "rows"), (2, "rows"),
                          (2, "registers+arrive"), (1, "rows+arrive"), (2, "rows+arrive"),
                          (2, "registers+early"), (1, "rows+early"), (2, "rows+early")]
    if tables.startswith("registers") or shape[4].get("block_t", 128) % 128 == 0])
def test_gpu_mosaic_fp4_converter(B, S, H, T, opts, slots, tables, monkeypatch):
    """fp4_converter (session 49, first compiled on a GPU after it): a second warpgroup converts each block into
    e5m2 slots in shared memory, the scoring warpgroup's wgmma reads them there. The operands are the register
    path's bytes (the same inline PTX), so the scores equal the register path's bit for bit and the reference's to
    the fp8 tensor cores' accumulation; under the segment-set top-k (through MOSAIC_CONFIG) the same index sets.
    fp4_tables "shared": the keys' tables built once a key into shared memory (block_t a multiple of 128).
    "rows" (fp4_layout "rows", session 50): a thread converts whole key rows and the channels keep their order, so
    the wgmma sums the same exact products in another order: the register path's scores to the accumulation's
    rounding, and sets that differ only by near-ties. "+arrive": conv_sync "arrive" (session 74: the converter
    fences and arrives per thread with no warpgroup barrier, the scorer issues the key copies). "+early": conv_sync
    "early" (session 75: the converter issues the key copies right after the conversion, then fences and arrives
    per thread)."""
    from pallas_kernels.indexer import gpu_mosaic

    tables, _, sync = tables.partition("+")
    monkeypatch.setitem(gpu_mosaic.MOSAIC_CONFIG, "conv_sync", sync or "commit")
    rows = tables == "rows"
    monkeypatch.setitem(gpu_mosaic.MOSAIC_CONFIG, "fp4_tables", "registers" if rows else tables)
    monkeypatch.setitem(gpu_mosaic.MOSAIC_CONFIG, "fp4_layout", "rows" if rows else "fragments")
    q, w, keys, nv = make(B, S, H, T, "fp4", True)
    opts = dict(opts, precision="fp8")
    conv = np.asarray(gpu_mosaic.indexer_scores_mosaic(q, w, keys, nv, fp4_converter=slots, **opts))
    regs = np.asarray(gpu_mosaic.indexer_scores_mosaic(q, w, keys, nv, fp4_converter=0, **opts))
    if rows:
        np.testing.assert_array_equal(np.isfinite(conv), np.isfinite(regs))
        fin = np.isfinite(regs)
        np.testing.assert_allclose(conv[fin], regs[fin], rtol=0, atol=1e-5 * np.abs(regs[fin]).max())
    else:
        np.testing.assert_array_equal(conv, regs)
    monkeypatch.setitem(gpu_mosaic.MOSAIC_CONFIG, "fp4_converter", slots)
    check_scores(q, w, keys, nv, "pallas", 1e-4, kernel="mosaic", **opts)
    # the segment top-k's finals: the Triton one (default), and at B = 64 x 32768 (4 splits a row) the last split's
    # and the cluster's, whose consumer warpgroup meets the row's other CTAs while the converter has exited
    s = np.asarray(indexer_scores(q, w, keys, nv)) if rows else None
    for final in ("triton",) + (("last", "cluster") if B == 64 else ()):
        monkeypatch.setitem(gpu_mosaic.SELECT_CONFIG, "final", final)
        monkeypatch.setitem(gpu_mosaic.MOSAIC_CONFIG, "fp4_converter", slots)
        got = np.asarray(indexer_topk(q, w, keys, nv, k=512, impl="pallas", picks="set", topk="segment_set"))
        monkeypatch.setitem(gpu_mosaic.MOSAIC_CONFIG, "fp4_converter", 0)
        want = np.asarray(indexer_topk(q, w, keys, nv, k=512, impl="pallas", picks="set", topk="segment_set"))
        if not rows:
            np.testing.assert_array_equal(got, want, err_msg=f"final {final}")
            continue
        # near-ties may swap: the sets' reference scores, ranked, agree to the accumulation's rounding
        np.testing.assert_array_equal(np.sum(got >= 0, -1), np.sum(want >= 0, -1), err_msg=f"final {final}")

        def ranked(p):
            v = np.where(p >= 0, np.take_along_axis(s, np.maximum(p, 0), -1), -np.inf)
            return -np.sort(-v, axis=-1)

        rg, rw = ranked(got), ranked(want)
        m = np.isfinite(rw)
        scale = np.broadcast_to(np.where(np.isfinite(s), np.abs(s), 0).max(-1, keepdims=True), rw.shape)
        np.testing.assert_array_less(np.abs(rg[m] - rw[m]), 1e-4 * scale[m] + 1e-7, err_msg=f"final {final}")


@gpu
@pytest.mark.parametrize("precision,tol", [("f16", 1e-5), ("fp8", 1e-4)])
def test_gpu_mosaic_fp4_wide_group_scales(precision, tol):
    """fp4 keys whose 32-channel groups lie up to 2^20 apart (the f16 operand factors 2^(15 - D) down to 2^-5; the
    e5m2 tables 2^(13 - D), exact to D = 26) and q whose groups do too: still the reference's scores to f32
    rounding on the Mosaic kernel (precision "fp8": to the fp8 tensor cores' accumulation)."""
    rng = np.random.default_rng(31)
    B, T, H = 4, 3000, 64
    k = rng.standard_normal((B, T, 128)) * np.ldexp(1.0, -rng.integers(0, 21, (B, T, 4)).repeat(32, -1))
    q = rng.standard_normal((B, 1, H, 128)) * np.ldexp(1.0, -rng.integers(0, 12, (B, 1, H, 4)).repeat(32, -1))
    q = F.fake_quantize(jnp.asarray(q, jnp.float32), "fp4")
    keys = F.quantize(jnp.asarray(k, jnp.float32), "fp4")
    w = jnp.asarray(rng.standard_normal((B, 1, H)), jnp.float32)
    nv = jnp.asarray(rng.integers(1, T + 1, (B, 1)), jnp.int32)
    check_scores(q, w, keys, nv, "pallas", tol, kernel="mosaic", precision=precision)


@gpu
@pytest.mark.parametrize("B,S,H,T,opts", [(4, 1, 64, 5000, {}), (2, 2, 64, 70000, {}), (3, 1, 16, 776, {}),
                                          (2, 1, 128, 296, {}), (3, 1, 64, 4104, dict(block_t=64, num_stages=4)),
                                          (2, 1, 64, 9000, dict(block_t=128, num_stages=3, num_splits=3)),
                                          (5, 1, 40, 2000, dict(num_splits=1, num_stages=1)),
                                          (4, 1, 64, 5000, dict(precision="bf16")), (2, 2, 64, 70000, dict(split_m=True))])
def test_gpu_mosaic_bf16_scores(B, S, H, T, opts):
    """The Mosaic GPU kernel over bf16 keys (session 27): scores and picks against the reference; ragged n_visible
    (0, inside, past T), heads padded to 32, odd splits, 1-4 slots, 64- and 128-key blocks. precision "bf16x2"
    (the default: q as bf16 hi + lo, ~16 mantissa bits, like the Triton kernel's default for bf16 keys) agrees to
    ~1e-5 of the row scale; "bf16" (q rounded to bf16) to bf16's rounding of q."""
    q, w, keys, nv = make(B, S, H, T, "bf16", True)
    one_term = opts.get("precision") == "bf16"
    check_scores(q, w, keys, nv, "pallas", 1e-2 if one_term else 1e-5, kernel="mosaic", **opts)
    out = np.asarray(indexer_scores_pallas(q, w, keys, nv, impl="pallas", kernel="mosaic", pad_to_block=True, **opts))
    assert out.shape[-1] % opts.get("block_t", 128) == 0 and np.all(out[..., T:] == -np.inf)
    if one_term:
        return
    picks = indexer_topk(q, w, keys, nv, k=512, impl="pallas", kernel="mosaic", **opts)
    check_picks(picks, q, w, keys, nv, 512, tol=1e-4)
    got = indexer_topk(q, w, keys, nv, k=512, impl="pallas", kernel="mosaic", picks="set", **opts)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(as_index_set(picks)))


def test_mosaic_auto_rule_shapes():
    """`gpu_mosaic.auto_takes` on V4 shapes (no kernel runs): B=64 decode over fp8 / bf16 keys; batch 1 over bf16
    keys only where its 128-key blocks fill a wave of CTAs (1M context: 2048 blocks; 128K: 256, stays on Triton);
    fp4 keys at B=64 (session 31); never prefill, or batch 1 over fp8 / fp4."""
    from pallas_kernels.indexer import formats, gpu_mosaic

    sds = jax.ShapeDtypeStruct
    q = lambda B, S: sds((B, S, 64, 128), jnp.float32)
    bf16 = lambda B, T: sds((B, T, 128), jnp.bfloat16)
    fp8 = lambda B, T: formats.QuantizedKeys(sds((B, T, 128), jnp.float8_e4m3fn), sds((B, T, 1), jnp.float32), "fp8")
    fp4 = lambda B, T: formats.QuantizedKeys(sds((B, T, 64), jnp.uint8), sds((B, T, 4), jnp.uint8), "fp4")
    assert gpu_mosaic.auto_takes(q(64, 1), bf16(64, 32768)) and gpu_mosaic.auto_takes(q(64, 1), fp8(64, 32768))
    assert gpu_mosaic.auto_takes(q(1, 1), bf16(1, 262144))
    assert not gpu_mosaic.auto_takes(q(1, 1), bf16(1, 32768)) and not gpu_mosaic.auto_takes(q(1, 1), fp8(1, 262144))
    assert gpu_mosaic.auto_takes(q(64, 1), fp4(64, 32768)) and not gpu_mosaic.auto_takes(q(1, 1), fp4(1, 262144))
    assert not gpu_mosaic.auto_takes(q(1, 8), bf16(1, 262144))


@gpu
def test_gpu_auto_takes_mosaic_for_fp8_decode(monkeypatch):
    """kernel "auto": decode (<= 2 queries per row, >= 16 query rows) over fp8, bf16 (session 27) or fp4 keys
    (session 31) with head_dim 128 and T % 8 == 0 goes to the Mosaic kernel; prefill, batch < 16, f32 keys, T % 8
    != 0 and explicitly tuned calls stay on Triton. Scores against the reference either way."""
    from pallas_kernels.indexer import gpu_mosaic

    monkeypatch.setattr(gpu_mosaic, "AUTO", True)   # the default (session 21)
    calls = []
    real = gpu_mosaic.indexer_scores_mosaic
    monkeypatch.setattr(gpu_mosaic, "indexer_scores_mosaic", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    for (B, S, T, fmt, opts, mosaic) in [(16, 1, 800, "fp8", {}, True), (8, 2, 800, "fp8", {}, True),
                                         (2, 1, 800, "fp8", {}, False), (6, 3, 800, "fp8", {}, False),
                                         (16, 1, 804, "fp8", {}, False), (16, 1, 800, "fp4", {}, True),
                                         (16, 1, 800, "bf16", {}, True), (16, 1, 800, None, {}, False),
                                         (16, 1, 800, "fp8", dict(block_t=64), False)]:
        q, w, keys, nv = make(B, S, 64, T, fmt, True)
        n = len(calls)
        check_scores(q, w, keys, nv, "pallas", 1e-5, **opts)
        assert (len(calls) > n) == mosaic, (B, S, T, fmt, opts)
    # fewer rows over bf16 keys whose blocks fill a wave of CTAs (2 rows x 7 blocks of 128 keys >= 14; session 28)
    monkeypatch.setattr(gpu_mosaic, "MIN_KEY_BLOCKS", 14)
    for (B, T, fmt, mosaic) in [(2, 800, "bf16", True), (1, 800, "bf16", False), (2, 800, "fp8", False)]:
        n = len(calls)
        check_scores(*make(B, 1, 64, T, fmt, True), "pallas", 1e-5)
        assert (len(calls) > n) == mosaic, (B, T, fmt)
    monkeypatch.setattr(gpu_mosaic, "AUTO", False)   # switched off: Triton everywhere
    n = len(calls)
    check_scores(*make(16, 1, 64, 800, "fp8", True), "pallas", 1e-5)
    assert len(calls) == n


@full_tier   # ~20 s a case in the GPU interpreter; CI lowers the kernel for CUDA (test_gpu_lowering.py)
@pytest.mark.parametrize("B,S,H,T,opts", [(16, 1, 16, 16, {}), (3, 1, 16, 776, dict(num_splits=2, num_stages=2)),
                                          (2, 2, 32, 1000, dict(block_t=64, num_stages=3)),
                                          (2, 1, 64, 1544, dict(block_t=256, num_splits=3, num_stages=1))])
@pytest.mark.parametrize("fmt", ["fp8", "bf16"])
def test_mosaic_kernel_interpreted(B, S, H, T, opts, fmt):
    """The Mosaic GPU kernel (precision "fp8") in Pallas' GPU interpreter: simulated shared memory, barriers and TMA
    with the race detector on, reads past an array's end returning NaN (the masking must drop them): scores equal the
    reference to f32 summation order (the interpreter's fp8 dot accumulates in f32), -inf exactly where the reference
    has it, no race. Covers T below one block (16 keys, 64-key blocks: the model test's shape), ragged n_visible
    (0, inside, past T), a ragged last split, 1-3 slots, 2 queries per row. bf16 keys (precision "bf16x2", the
    default: q's hi and lo terms into one accumulator) agree to the split's ~16-bit q mantissa."""
    if ON_GPU:
        pytest.skip("CPU interpreter test (on a GPU, impl='pallas' compiles the kernel: test_gpu_mosaic_fp8_scores)")
    gpu_interpret = pytest.importorskip("jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call")
    from pallas_kernels.indexer.gpu_mosaic import indexer_scores_mosaic

    q, w, keys, nv = make(B, S, H, T, fmt, True)
    precision = "fp8" if fmt == "fp8" else None
    # through the dispatcher (kernel="mosaic" on CPU = the interpreter)
    check_scores(q, w, keys, nv, "pallas", 1e-6 if fmt == "fp8" else 1e-5, kernel="mosaic", precision=precision,
                 **opts)
    gpu_interpret.reset_gpu_interpret_mode_state()
    out = np.asarray(indexer_scores_mosaic(q, w, keys, nv, interpret="races", precision=precision,
                                           pad_to_block=True, **opts))
    assert not gpu_interpret.get_races().races_found
    ref = np.asarray(indexer_scores(q, w, keys, nv))
    np.testing.assert_array_equal(out[..., :T] == -np.inf, ref == -np.inf)
    assert np.all(out[..., T:] == -np.inf)


@pytest.mark.parametrize("B,S,H,T,opts", sweep([core(2, 1, 32, 296, dict(block_t=64, num_stages=3, fp4_converter=1)),
                                          (3, 1, 16, 776, dict(num_splits=2, num_stages=2, fp4_converter=2)),
                                          (2, 2, 32, 1000, dict(block_t=64, num_stages=2, fp4_converter=3)),
                                          (2, 1, 64, 1544, dict(block_t=256, num_splits=3, num_stages=1,
                                                                fp4_converter=2)),
                                          # fp4_layout "rows" (session 50): q unpermuted, the model in channel order
                                          core(2, 1, 32, 296, dict(block_t=128, num_stages=2, fp4_converter=2,
                                                                   layout="rows")),
                                          (2, 2, 16, 1544, dict(block_t=256, num_splits=2, num_stages=2,
                                                                fp4_converter=1, layout="rows")),
                                          # conv_sync "arrive" (session 74): the scorer issues the key copies
                                          # once the slot's full barrier completed (the race detector checks
                                          # the ring's reuse); the default "commit" has the converter refill it
                                          core(3, 1, 16, 776, dict(num_splits=2, num_stages=2, fp4_converter=2,
                                                                   layout="rows", conv_sync="arrive")),
                                          # conv_sync "early" (session 75): the converter refills the key slot
                                          # right after its conversion, before the stores
                                          core(3, 1, 16, 776, dict(num_splits=2, num_stages=2, fp4_converter=2,
                                                                   layout="rows", conv_sync="early")),
                                          # q_prep "fused" (session 76): the scorer makes its row's e5m2 q and
                                          # weights from the raw q (64 heads: whole WGMMA tiles)
                                          core(2, 1, 64, 264, dict(num_splits=2, num_stages=2, fp4_converter=2,
                                                                   layout="rows", q_prep="fused"))]))
def test_mosaic_fp4_converter_interpreted(B, S, H, T, opts, monkeypatch):
    """fp4 keys through the Mosaic kernel's converter warpgroup (fp4_converter, session 49) in Pallas' GPU
    interpreter: wg 1 streams the key ring and converts each block into e5m2 slots (the interpreter's jnp model of
    the inline PTX, equal to it bit for bit: test_indexer_mosaic_fp4.py), wg 0 scores them from shared memory.
    Race detector on; the reference's scores to f32 summation order (the e5m2 operands are exact and the
    interpreter's dot accumulates in f32); ragged n_visible (0, inside, past T), 1-3 slots against 1-3 key slots,
    more blocks than slots, 2 queries per row; through the dispatcher with MOSAIC_CONFIG's fp4_converter too; both
    fp4_layouts ("rows": channel c in column c, so q goes unpermuted)."""
    if ON_GPU:
        pytest.skip("CPU interpreter test (the GPU runs test_gpu_mosaic_fp4_converter)")
    gpu_interpret = pytest.importorskip("jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call")
    from pallas_kernels.indexer import gpu_mosaic

    opts = dict(opts)
    monkeypatch.setitem(gpu_mosaic.MOSAIC_CONFIG, "fp4_layout", opts.pop("layout", "fragments"))
    monkeypatch.setitem(gpu_mosaic.MOSAIC_CONFIG, "conv_sync", opts.pop("conv_sync", "commit"))
    q_prep = opts.pop("q_prep", "triton")
    q, w, keys, nv = make(B, S, H, T, "fp4", True)
    gpu_interpret.reset_gpu_interpret_mode_state()
    monkeypatch.setitem(gpu_mosaic.MOSAIC_CONFIG, "q_prep", q_prep)
    out = np.asarray(gpu_mosaic.indexer_scores_mosaic(q, w, keys, nv, interpret="races", pad_to_block=True, **opts))
    assert not gpu_interpret.get_races().races_found
    if q_prep == "fused":   # the same scores as the Triton q kernel's operand, bit for bit, from a raw q too
        monkeypatch.setitem(gpu_mosaic.MOSAIC_CONFIG, "q_prep", "triton")
        triton = np.asarray(gpu_mosaic.indexer_scores_mosaic(q, w, keys, nv, interpret=True, pad_to_block=True,
                                                             **opts))
        np.testing.assert_array_equal(out, triton)
        monkeypatch.setitem(gpu_mosaic.MOSAIC_CONFIG, "q_prep", "fused")
        raw_q = q + 0.01 * jnp.asarray(np.random.default_rng(76).standard_normal(q.shape), q.dtype)
        np.testing.assert_array_equal(
            np.asarray(gpu_mosaic.indexer_scores_mosaic(raw_q, w, keys, nv, interpret=True, pad_to_block=True, **opts)),
            np.asarray(gpu_mosaic.indexer_scores_mosaic(F.fake_quantize(raw_q, "fp4"), w, keys, nv, interpret=True,
                                                        pad_to_block=True, **opts)))
    ref = np.asarray(indexer_scores(q, w, keys, nv))
    fin = np.isfinite(ref)
    np.testing.assert_array_equal(np.isfinite(out[..., :T]), fin)
    assert np.all(out[..., T:] == -np.inf)
    np.testing.assert_allclose(out[..., :T][fin], ref[fin], rtol=0, atol=1e-6 * np.abs(ref[fin]).max())
    # the config reaches the kernel through the dispatcher (kernel="mosaic" on CPU = the interpreter)
    monkeypatch.setitem(gpu_mosaic.MOSAIC_CONFIG, "fp4_converter", opts["fp4_converter"])
    check_scores(q, w, keys, nv, "pallas", 1e-6, kernel="mosaic",
                 **{k: v for k, v in opts.items() if k != "fp4_converter"})


def test_mosaic_fp4_converter_rejects_what_it_cannot_do():
    """fp4_converter's option errors: fp4 keys at precision "fp8" only, not with the raw-conversion probe or
    split_m, 0-4 slots; the fp4 register path still has no interpret mode."""
    from pallas_kernels.indexer.gpu_mosaic import indexer_scores_mosaic

    q, w, keys, nv = make(1, 1, 16, 64, "fp4", True)
    for opts, msg in [(dict(precision="f16"), "fp4_converter applies"), (dict(convert="raw"), "fp4_converter applies"),
                      (dict(split_m=True), "fp4_converter applies"), (dict(fp4_converter=5), "fp4_converter must be")]:
        with pytest.raises(ValueError, match=msg):
            indexer_scores_mosaic(q, w, keys, nv, **{"fp4_converter": 2, **opts})
    with pytest.raises(ValueError, match="fp4_converter applies"):
        indexer_scores_mosaic(*make(1, 1, 16, 64, "fp8", True), fp4_converter=1)
    with pytest.raises(ValueError, match="interpret mode runs"):
        indexer_scores_mosaic(q, w, keys, nv, interpret=True, fp4_converter=0)
    from pallas_kernels.indexer import gpu_mosaic

    for cfg, opts, msg in [(dict(fp4_layout="columns"), {}, "fp4_layout'] must be one of"),
                           (dict(fp4_layout="rows"), dict(block_t=64), "block_t must be a multiple of 128"),
                           (dict(fp4_layout="rows", fp4_tables="shared"), dict(block_t=128), "does not apply")]:
        saved = dict(gpu_mosaic.MOSAIC_CONFIG)
        gpu_mosaic.MOSAIC_CONFIG.update(cfg)
        try:
            with pytest.raises(ValueError, match=msg):
                indexer_scores_mosaic(q, w, keys, nv, fp4_converter=2, **opts)
        finally:
            gpu_mosaic.MOSAIC_CONFIG.update(saved)
    # under the segment top-k, 2+ e5m2 slots take the key ring to 2 slots (two CTAs an SM); a given count overrides
    from pallas_kernels.indexer.gpu_mosaic import launch_layout

    assert [launch_layout(64, 32768, "fp4", select=True, converter=c)[1] for c in (0, 1, 2, 4)] == [3, 3, 2, 2]
    assert launch_layout(64, 32768, "fp4", select=True, converter=2, num_stages=3)[1] == 3
    assert launch_layout(64, 32768, "fp4", converter=2)[1] == 4   # the scores alone keep their 4 slots


def test_e4m3_f16_bit_placement_constants():
    """The integer conversion of precision="f16", convert="alu" (`gpu_mosaic.E4M3_F16_ALU_ASM`, modelled bit for
    bit by `e4m3_to_f16_alu_reference`): every e4m3 code but NaN gives the f16 of its value x 2^-8 exactly,
    subnormals, zeros and the sign included, in element order (bytes 0..3 -> halves 0..3)."""
    import ml_dtypes
    from pallas_kernels.indexer.gpu_mosaic import F16_BIAS_SHIFT, e4m3_to_f16_alu_reference

    codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8)             # 0x7F / 0xFF: NaN
    codes = np.concatenate([codes, np.zeros((-len(codes)) % 4, np.uint8)])
    rng = np.random.default_rng(0)
    codes = np.concatenate([codes, rng.permutation(codes)])                              # every byte position
    got = e4m3_to_f16_alu_reference(codes).view(np.float16)
    want = (codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * 2.0 ** -F16_BIAS_SHIFT).astype(np.float16)
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize("fmt,opts", [full("fp8", {}), full("bf16", dict(num_splits=3)), full("fp8", dict(block_t=64)),
                                      full("fp4", {})])   # fp4: the default converter + rows layout (~3 min)
def test_mosaic_group_max_interpreted(fmt, opts):
    """group_max_k: the Mosaic kernel's per-CTA strided-group maxima (ordered int32 keys) equal the maxima of its own
    scores over each split's blocks, and the threshold top-k fed with them picks what it picks without them (GPU
    interpreter on the CPU; precision "fp8" / "bf16x2")."""
    if ON_GPU:
        pytest.skip("CPU interpreter test (the GPU runs test_gpu_mosaic_group_max)")
    pytest.importorskip("jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call")
    from pallas_kernels.indexer.gpu import indexer_topk_gpu
    from pallas_kernels.indexer.gpu_mosaic import indexer_scores_mosaic

    check_mosaic_group_max(indexer_scores_mosaic, indexer_topk_gpu, fmt, opts, interpret=True)


def check_mosaic_group_max(scores_fn, topk_fn, fmt, opts, interpret):
    from pallas_kernels.indexer.topk import _ordered_i32, threshold_groups

    B, H, T, k = 3, 16, 4096, 64
    q, w, keys, nv = make(B, 1, H, T, fmt, True)
    nv = nv.at[0, 0].set(1000)                                       # a split past n_visible: maxima of -inf
    precision = "fp8" if fmt == "fp8" and interpret else None
    out, gmax = scores_fn(q, w, keys, nv, pad_to_block=True, group_max_k=k, precision=precision,
                          interpret=interpret, **opts)
    G = threshold_groups(out.shape[-1], k)
    assert gmax is not None and gmax.dtype == jnp.int32 and gmax.shape[:2] == (B, 1) and gmax.shape[-1] == G
    n_split = gmax.shape[2]
    bt = opts.get("block_t", 128)
    ok = np.asarray(_ordered_i32(out))                                # [B, 1, T_out]
    blocks = ok.reshape(B, 1, -1, bt)
    nb = blocks.shape[2]
    bps = -(-nb // n_split)
    for sp in range(n_split):
        part = np.full((B, 1, G), np.asarray(_ordered_i32(jnp.full((), -jnp.inf))), np.int32)   # no block yet
        for j in range(sp * bps, min(nb, (sp + 1) * bps)):
            g0 = (j * bt) % G
            part[..., g0:g0 + bt] = np.maximum(part[..., g0:g0 + bt], blocks[:, :, j])
        np.testing.assert_array_equal(np.asarray(gmax[:, :, sp]), part)
    fused = topk_fn(q, w, keys, nv, k=k, kernel="mosaic", topk="threshold_set", fuse_group_max=True,
                    precision=precision, interpret=interpret, **opts)
    plain = topk_fn(q, w, keys, nv, k=k, kernel="mosaic", topk="threshold_set", precision=precision,
                    interpret=interpret, **opts)
    np.testing.assert_array_equal(np.asarray(fused), np.asarray(plain))


@gpu
@pytest.mark.parametrize("fmt,opts", [("fp8", {}), ("fp8", dict(convert="mix")), ("bf16", dict(num_splits=3)),
                                      ("fp8", dict(block_t=64))])
def test_gpu_mosaic_group_max(fmt, opts):
    """test_mosaic_group_max_interpreted compiled on the GPU (fp8 keys at precision "f16", the default)."""
    from pallas_kernels.indexer.gpu import indexer_topk_gpu
    from pallas_kernels.indexer.gpu_mosaic import indexer_scores_mosaic

    check_mosaic_group_max(indexer_scores_mosaic, indexer_topk_gpu, fmt, opts, interpret=False)


@pytest.mark.parametrize("impl", ["reference", "pallas", "interpret_tpu"])
def test_indexer_argument_errors(impl):
    """Every implementation rejects malformed arguments before any kernel runs, naming the argument: before
    session 37 a wrong weights shape or a larger keys batch ran the GPU kernel on the wrong rows, and a [B] n_visible
    broadcast silently in the reference."""
    from pallas_kernels.indexer.reference import indexer_scores as scores_reference

    q, w, keys, nv = make(2, 3, 4, 40, None)
    q8, w8, keys8, nv8 = make(2, 3, 4, 40, "fp8")
    q4, w4, keys4, nv4 = make(2, 3, 4, 64, "fp4")
    bad = [
        (dict(q=q[0]), "q must be \\[batch, queries, heads, head_dim\\]"),
        (dict(q=q.astype(jnp.int32)), "q must be floating point"),
        (dict(weights=w[..., :3]), "weights must be \\[batch, queries, heads\\] = \\(2, 3, 4\\)"),
        (dict(weights=w.astype(jnp.int32)), "weights must be floating point"),
        (dict(keys=keys[:1]), "keys must be \\[batch=2, T, head_dim=128\\]"),
        (dict(keys=jnp.concatenate([keys, keys])), "keys must be \\[batch=2"),
        (dict(keys=keys[..., :64]), "head_dim=128"),
        (dict(keys=keys[:, :0]), "at least one entry"),
        (dict(keys=keys.astype(jnp.int32)), "keys must be floating point"),
        (dict(keys=F.QuantizedKeys(keys8.values, keys8.scale[..., 0], "fp8")), "fp8 keys' scale must be"),
        (dict(keys=F.QuantizedKeys(keys8.values.astype(jnp.float32), keys8.scale, "fp8")), "must hold float8_e4m3fn"),
        (dict(keys=F.QuantizedKeys(keys4.values, keys4.scale[..., :2], "fp4")), "fp4 keys' scale must be"),
        (dict(keys=F.QuantizedKeys(keys4.values[..., :32], keys4.scale, "fp4")), "fp4 keys' values must be"),
        (dict(keys=F.QuantizedKeys(keys8.values, keys8.scale, "fp6")), "fmt must be one of"),
        (dict(n_visible=nv[:, 0]), "n_visible must be \\[batch, queries\\] = \\(2, 3\\)"),
        (dict(n_visible=nv.astype(jnp.float32)), "n_visible must be an integer array"),
        (dict(k=0), "k must be an integer >= 1"),
        (dict(k=2.5), "k must be an integer >= 1"),
        (dict(query_chunk=0), "query_chunk must be an integer >= 1"),
    ]
    good = dict(q=q, weights=w, keys=keys, n_visible=nv)
    for change, msg in bad:
        args = dict(good, **change)
        k = args.pop("k", 8)
        query_chunk = args.pop("query_chunk", 256)
        with pytest.raises(ValueError, match=msg):
            indexer_topk(**args, k=k, query_chunk=query_chunk, impl=impl)
        if "k" not in change and "query_chunk" not in change:
            with pytest.raises(ValueError, match=msg):
                indexer_scores_pallas(**args, impl=impl)
    with pytest.raises(ValueError, match="n_visible must be"):   # the contract itself checks too
        scores_reference(q, w, keys, nv[:, 0])


@full_tier
def test_mosaic_kernel_errors():
    """kernel='mosaic' is the fp8 / fp4 / bf16-key Mosaic GPU kernel: no interpreter for precision 'f16', no other key
    format, no Triton knobs, T a multiple of 8."""
    from pallas_kernels.indexer.gpu import indexer_scores_gpu

    q, w, keys, nv = make(1, 1, 16, 40, "fp8")
    with pytest.raises(ValueError, match="interpret mode runs fp8 keys at precision 'fp8', bf16 keys and fp4 keys "
                                         "with fp4_converter only"):
        indexer_scores_gpu(q, w, keys, nv, interpret=True, kernel="mosaic")
    with pytest.raises(ValueError, match="kernel must be one of"):
        indexer_scores_gpu(q, w, keys, nv, interpret=True, kernel="cuda")
    # an explicit kernel="mosaic" is validated before anything is compiled: these run on the CPU too
    qb, wb, kb, nb = make(1, 1, 16, 40, None)
    with pytest.raises(ValueError, match="takes fp8 or fp4 keys .* or bf16"):
        indexer_scores_gpu(qb, wb, kb, nb, kernel="mosaic")
    from pallas_kernels.indexer import gpu_mosaic

    saved = dict(gpu_mosaic.MOSAIC_CONFIG)
    gpu_mosaic.MOSAIC_CONFIG["fp4_converter"] = 0   # fp4's register path: compiled only (the default converter
    try:                                            # interprets)
        with pytest.raises(ValueError, match="interpret mode runs"):
            indexer_scores_gpu(*make(1, 1, 16, 40, "fp4"), kernel="mosaic", interpret=True)
    finally:
        gpu_mosaic.MOSAIC_CONFIG.update(saved)
    with pytest.raises(ValueError, match="takes only"):
        indexer_scores_gpu(q, w, keys, nv, kernel="mosaic", num_warps=8)
    with pytest.raises(ValueError, match="multiple of 8"):
        indexer_scores_gpu(*make(1, 1, 16, 44, "fp8"), kernel="mosaic")
    with pytest.raises(ValueError, match="split_m needs"):
        indexer_scores_gpu(q, w, keys, nv, kernel="mosaic", split_m=True, precision="fp8", interpret=True)
    with pytest.raises(ValueError, match="split_m needs"):
        indexer_scores_gpu(*make(1, 1, 16, 400, "fp8"), kernel="mosaic", split_m=True, block_t=64)
    with pytest.raises(ValueError, match="convert must be one of"):
        indexer_scores_gpu(q, w, keys, nv, kernel="mosaic", convert="lut")
    with pytest.raises(ValueError, match="applies to precision='f16'"):
        indexer_scores_gpu(q, w, keys, nv, kernel="mosaic", convert="alu", precision="fp8")
    with pytest.raises(ValueError, match="options of the Mosaic kernel"):
        indexer_scores_gpu(q, w, keys, nv, kernel="triton", convert="alu")


@full_tier
def test_fp4_asm_decode_errors():
    """The inline-PTX decode has no interpreter and only applies to fp4 keys with f16 operands."""
    from pallas_kernels.indexer.gpu import indexer_scores_gpu

    q, w, keys, nv = make(1, 1, 16, 64, "fp4", True)
    with pytest.raises(ValueError, match="no interpret mode"):
        indexer_scores_gpu(q, w, keys, nv, interpret=True, fp4_decode="asm")
    with pytest.raises(ValueError, match="fp4_decode must be one of"):
        indexer_scores_gpu(q, w, keys, nv, interpret=True, fp4_decode="lut")
    q8, w8, keys8, nv8 = make(1, 1, 16, 64, "fp8", True)
    with pytest.raises(ValueError, match="applies to fp4 keys"):
        indexer_scores_gpu(q8, w8, keys8, nv8, fp4_decode="asm")
    with pytest.raises(ValueError, match="needs block_t >= 32"):   # 4 bytes per thread per asm instance
        indexer_scores_gpu(q, w, keys, nv, fp4_decode="asm", block_t=16, num_warps=4)


@gpu
def test_gpu_auto_jits():
    q, w, keys, nv = make(2, 1, 64, 3000, "fp4", True)
    f = jax.jit(lambda *a: indexer_topk(*a, k=512, impl="auto"))
    check_picks(f(q, w, keys, nv), q, w, keys, nv, 512)


def test_bf16x2_split_survives_jit():
    """bf16x2 q operands: hi + lo reproduce q to ~16 bits under jit (XLA GPU folds a two-cast bf16 round trip, which
    once made lo = 0 there; the split is bit arithmetic now); round_to_bf16 == the two casts."""
    from pallas_kernels.indexer.gpu import split_q
    from pallas_kernels.numerics import round_to_bf16

    rng = np.random.default_rng(next(_SEED))
    q = jnp.asarray(rng.standard_normal((2, 3, 4, 128)) * np.exp(rng.uniform(-20, 20, (2, 3, 4, 128))), jnp.float32)
    (hi, lo), n = jax.jit(lambda x: split_q(x, "bf16", "bf16x2"))(q)
    assert n == 2 and hi.dtype == lo.dtype == jnp.bfloat16
    rel = np.abs(np.asarray(hi, np.float32) + np.asarray(lo, np.float32) - np.asarray(q)) / np.abs(np.asarray(q))
    assert rel.max() < 2e-5 and np.abs(np.asarray(lo, np.float32)).max() > 0
    np.testing.assert_array_equal(np.asarray(jax.jit(round_to_bf16)(q)),
                                  np.asarray(q.astype(jnp.bfloat16).astype(jnp.float32)))
    from pallas_kernels.numerics import round_to                           # the per-dtype helper (compressor ref)

    for dt in (jnp.bfloat16, jnp.float16, jnp.float32):
        np.testing.assert_array_equal(np.asarray(round_to(q, dt)), np.asarray(q.astype(dt).astype(jnp.float32)))


@full_tier
def test_default_threshold_topk_end_to_end():
    """The default top-k ("threshold": bound, compaction, top_k over the survivors) through indexer_topk: T large
    enough for the compaction path, causal prefill in query chunks (lax.map) with short valid prefixes, k = 64."""
    q, w, keys, nv = make(1, 11, 16, 3000, "fp8", rotate=True, causal=True)
    check_picks(indexer_topk(q, w, keys, nv, k=64, query_chunk=4, impl="pallas"), q, w, keys, nv, 64)
