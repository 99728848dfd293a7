"""The Mosaic indexer kernel's q preparation for fp8 keys in one Pallas kernel (`pallas_kernels/indexer/q_prep.py`,
`gpu_mosaic.MOSAIC_CONFIG["q_prep"] = "triton"`): equal bit for bit to the jnp path it replaces (formats' fp8
quantization of q, the codes as f16, the scale folded into the head weights), in the Pallas interpreter on the
CPU; lowered for CUDA; compiled on the GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.indexer import formats as F
from pallas_kernels.indexer import q_prep
from pallas_kernels.indexer.gpu import quantize_q_fp8
from tiers import full, full_tier

ON_GPU = jax.default_backend() == "gpu"


def test_scale_exponent_equals_formats_rule():
    """e = ceil(log2(max(amax, 1e-4) / 448)) from the bits equals `formats._pow2_exponent`'s (a division and frexp)
    on random magnitudes over 16 decades, at and one ulp either side of every 448 x 2^j, at the 1e-4 floor and 0."""
    rng = np.random.default_rng(7)
    edges = np.float32(448) * np.float32(2.0) ** np.arange(-40, 40)
    vals = np.concatenate([np.abs(rng.standard_normal(200000)) * np.float32(10.0) ** rng.integers(-8, 8, 200000),
                           edges, np.nextafter(edges, np.float32(np.inf)), np.nextafter(edges, np.float32(0)),
                           [0.0, 1e-4, np.nextafter(np.float32(1e-4), np.float32(0)), 1e-30, 3e38]]).astype(np.float32)
    a = jnp.asarray(vals)
    np.testing.assert_array_equal(np.asarray(q_prep._pow2_exponent_bits(a, F.E4M3_MAX, F.E4M3_AMAX_FLOOR)),
                                  np.asarray(F._pow2_exponent(a, F.E4M3_MAX, F.E4M3_AMAX_FLOOR)))


@pytest.mark.parametrize("R,H,fake,f16", [(5, 64, True, True), (3, 16, False, True), full(2, 128, True, True),
                                          (4, 32, True, False), (2, 48, True, True)])
def test_q_prep_kernel_equals_the_jnp_path(R, H, fake, f16):
    """The kernel (Pallas interpreter here) against `gpu.quantize_q_fp8` + the weights' scale + the f16 conversion:
    codes and weights bit for bit, for fake-quantized q (the contract) and raw q (rounded the same way), heads
    spanning 1e-3..300 in magnitude, the e4m3 codes themselves with f16=False (the kernel's precision "fp8"), and a
    head count that is not a power of two (padded inside with zero heads)."""
    rng = np.random.default_rng(R * 100 + H)
    q = jnp.asarray(rng.standard_normal((R, H, 128)) * rng.choice([1e-3, 1.0, 300.0], (R, H, 1)), jnp.float32)
    q = F.fake_quantize(q, "fp8") if fake else q
    w = jnp.asarray(rng.standard_normal((R, H)), jnp.float32)
    got_q, got_w = q_prep.q_prep_fp8(q, w, f16=f16, interpret=True)
    want_q, scale = quantize_q_fp8(q, "fp8")
    want_q = want_q.astype(jnp.float16) if f16 else want_q
    assert got_q.dtype == want_q.dtype
    np.testing.assert_array_equal(np.asarray(got_q.astype(jnp.float32)), np.asarray(want_q.astype(jnp.float32)))
    np.testing.assert_array_equal(np.asarray(got_w), np.asarray(w * scale))


def test_q_prep_head_blocks_agree():
    """The heads a program (`q_prep.HEAD_BLOCK`, MOSAIC_CONFIG q_prep_heads; session 54: 16, one program a row
    before) change only the grid: 16, 32 and 64 heads a program give the same operands and weights bit for bit, fp8
    and fp4 (with and without the permutation), 48 heads padded to the block; a block that is not a power of two >= 16
    is an error."""
    rng = np.random.default_rng(54)
    q = jnp.asarray(rng.standard_normal((3, 48, 128)) * rng.choice([1e-3, 1.0, 300.0], (3, 48, 1)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((3, 48)), jnp.float32)
    perm = q_prep.column_permutation(_fp4_columns())
    runs = {hb: (q_prep.q_prep_fp8(q, w, interpret=True, head_block=hb),
                 q_prep.q_prep_fp4(q, w, None, e5m2=True, interpret=True, head_block=hb),
                 q_prep.q_prep_fp4(q, w, perm, interpret=True, head_block=hb)) for hb in (16, 32, 64)}
    for hb in (32, 64):
        for got, want in zip(jax.tree.leaves(runs[hb]), jax.tree.leaves(runs[16])):
            np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    for hb in (8, 24):
        with pytest.raises(ValueError, match="head block"):
            q_prep.q_prep_fp8(q, w, interpret=True, head_block=hb)


def test_q_prep_errors():
    with pytest.raises(ValueError, match="power of two"):
        q_prep.q_prep_fp8(jnp.zeros((2, 64, 96)), jnp.zeros((2, 64)), interpret=True)
    with pytest.raises(ValueError, match="w must be"):
        q_prep.q_prep_fp8(jnp.zeros((2, 64, 128)), jnp.zeros((2, 48)), interpret=True)


def test_segment_set_with_q_prep_lowers(monkeypatch):
    """With MOSAIC_CONFIG q_prep "triton", the whole segment_set top-k over fp8 keys lowers for CUDA from this
    machine, the q preparation as its own Triton kernel; an unknown q_prep is refused."""
    from test_gpu_lowering import lowers_for
    from test_indexer_segment_select import _abstract_inputs

    from pallas_kernels.indexer import gpu_mosaic
    from pallas_kernels.indexer.gpu import indexer_topk_gpu

    monkeypatch.setitem(gpu_mosaic.MOSAIC_CONFIG, "q_prep", "triton")
    text = lowers_for("cuda", "mosaic_gpu", lambda *a: indexer_topk_gpu(*a, k=512, topk="segment_set"),
                      *_abstract_inputs(64, 32768, "fp8"))
    assert "indexer_q_prep_fp8" in text
    monkeypatch.setitem(gpu_mosaic.MOSAIC_CONFIG, "q_prep", "inline")
    with pytest.raises(ValueError, match="q_prep"):
        jax.eval_shape(lambda *a: indexer_topk_gpu(*a, k=512, topk="segment_set"), *_abstract_inputs(64, 32768, "fp8"))


@full_tier   # ~20 s in the GPU interpreter
def test_mosaic_kernel_interpreted_with_q_prep(monkeypatch):
    """The Mosaic kernel (precision "fp8", Pallas' GPU interpreter) scores the same with either q preparation."""
    if ON_GPU:
        pytest.skip("CPU interpreter test (test_gpu_q_prep_triton_equals_xla on the GPU)")
    pytest.importorskip("jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call")
    from test_indexer_kernels import make

    from pallas_kernels.indexer import gpu_mosaic
    from pallas_kernels.indexer.gpu_mosaic import indexer_scores_mosaic

    q, w, keys, nv = make(3, 1, 16, 776, "fp8", True)
    outs = []
    for prep in ("xla", "triton"):
        monkeypatch.setitem(gpu_mosaic.MOSAIC_CONFIG, "q_prep", prep)
        outs.append(np.asarray(indexer_scores_mosaic(q, w, keys, nv, interpret=True, precision="fp8", num_splits=2,
                                                     num_stages=2)))
    np.testing.assert_array_equal(outs[0], outs[1])


def test_mosaic_fp8_kernel_interpreted_with_fused_q_prep(monkeypatch):
    """q_prep "fused" (session 76) on fp8 keys (precision "fp8", Pallas' GPU interpreter with its race detector, 64
    heads: whole WGMMA tiles): the kernel makes its row's codes and weights from the raw q, and scores the same as
    with the Triton q kernel, bit for bit."""
    if ON_GPU:
        pytest.skip("CPU interpreter test (test_gpu_fused_q_prep_converter on the GPU)")
    gpu_interpret = pytest.importorskip("jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call")
    from test_indexer_kernels import make

    from pallas_kernels.indexer import gpu_mosaic
    from pallas_kernels.indexer.gpu_mosaic import indexer_scores_mosaic

    _, w, keys, nv = make(2, 1, 64, 264, "fp8", True)
    q = jnp.asarray(np.random.default_rng(76).standard_normal((2, 1, 64, 128)), jnp.float32)   # raw
    outs = {}
    for prep in ("triton", "fused"):
        monkeypatch.setitem(gpu_mosaic.MOSAIC_CONFIG, "q_prep", prep)
        gpu_interpret.reset_gpu_interpret_mode_state()
        outs[prep] = np.asarray(indexer_scores_mosaic(q, w, keys, nv, interpret="races", precision="fp8",
                                                      num_splits=2, num_stages=2))
        assert not gpu_interpret.get_races().races_found
    assert np.isfinite(outs["fused"]).any()
    np.testing.assert_array_equal(outs["fused"], outs["triton"])


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU (compiled Mosaic and Triton kernels)")
@pytest.mark.parametrize("B,H,T,topk", [(64, 64, 32768, "segment_set"), (16, 64, 20000, "auto_set"),
                                        (20, 32, 8192, "tour_set")])
def test_gpu_q_prep_triton_equals_xla(B, H, T, topk, monkeypatch):
    """On the GPU the Mosaic kernel's scores and the picks are the same bit for bit with either q preparation."""
    from test_indexer_kernels import make

    from pallas_kernels.indexer import gpu_mosaic, indexer_scores_pallas, indexer_topk

    q, w, keys, nv = make(B, 1, H, T, "fp8", True)
    runs = {}
    for prep in ("xla", "triton"):
        monkeypatch.setitem(gpu_mosaic.MOSAIC_CONFIG, "q_prep", prep)
        scores = jax.jit(lambda *a: indexer_scores_pallas(*a, impl="pallas", kernel="mosaic"))(q, w, keys, nv)
        picks = jax.jit(lambda *a: indexer_topk(*a, k=512, impl="pallas", picks="set", topk=topk,
                                                kernel="mosaic"))(q, w, keys, nv)
        runs[prep] = (np.asarray(scores), np.asarray(picks))
    np.testing.assert_array_equal(runs["xla"][0], runs["triton"][0])
    np.testing.assert_array_equal(runs["xla"][1], runs["triton"][1])


# ---------------------------------------------------------------------------------------------------------------
# fp4 keys: q fake-quantized, scaled and permuted in one kernel (`q_prep.q_prep_fp4`), and the dispatcher's raw q


def test_fp4_group_exponent_equals_formats_rule():
    """fp4's group exponent clip(ceil(log2(max(amax, 6 x 2^-126) / 6)), -127, 127) from the bits equals formats'
    (a division and frexp) on magnitudes over 60 decades, at and one ulp either side of every 6 x 2^j, and at 0."""
    rng = np.random.default_rng(11)
    edges = np.float32(6) * np.float32(2.0) ** np.arange(-130, 120)
    vals = np.concatenate([np.abs(rng.standard_normal(100000)) * np.float32(10.0) ** rng.integers(-30, 30, 100000),
                           edges, np.nextafter(edges, np.float32(np.inf)), np.nextafter(edges, np.float32(0)),
                           [0.0, 1e-45, 3e38]]).astype(np.float32)
    a = jnp.asarray(vals)
    want = jnp.clip(F._pow2_exponent(a, F.E2M1_MAX, F.E2M1_AMAX_FLOOR), -127, 127)
    got = jnp.clip(q_prep._pow2_exponent_bits(a, F.E2M1_MAX, F.E2M1_AMAX_FLOOR), -127, 127)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_round_e2m1_equals_the_conversion():
    """The bit-arithmetic e2m1 rounding equals XLA's conversion to float4_e2m1fn (ties to even, signed zeros) on
    every quarter-step in [-6, 6], one ulp either side of each, and random values."""
    rng = np.random.default_rng(12)
    grid = np.arange(-24, 25) / 4
    y = np.concatenate([rng.uniform(-6, 6, 100000), grid, np.nextafter(grid, 10), np.nextafter(grid, -10),
                        [-0.0, 1e-30, -1e-30]]).astype(np.float32)
    y = y[np.abs(y) <= 6]
    got = np.asarray(q_prep._round_e2m1(jnp.asarray(y)))
    want = np.asarray(jnp.asarray(y).astype(jnp.float4_e2m1fn).astype(jnp.float32))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


def test_frexp_exponent():
    rng = np.random.default_rng(13)
    vals = np.concatenate([np.abs(rng.standard_normal(50000)) * np.float32(10.0) ** rng.integers(-37, 37, 50000),
                           np.float32(2.0) ** np.arange(-126, 127), [0.0]]).astype(np.float32)
    x = jnp.asarray(vals)
    np.testing.assert_array_equal(np.asarray(q_prep._frexp_exponent(x)),
                                  np.asarray(jnp.where(x > 0, jnp.frexp(x)[1], 0)))


def _fp4_columns():
    from pallas_kernels.indexer.mosaic_fp4 import register_plan

    return register_plan(64)[1]


@pytest.mark.parametrize("R,H,fake", [(3, 64, True), (3, 64, False), (2, 32, False), full(2, 128, False),
                                      (2, 16, True), (2, 8, False), (2, 96, False)])
def test_q_prep_fp4_kernel_equals_the_jnp_path(R, H, fake):
    """The kernel (Pallas interpreter) against `gpu_mosaic.fp4_q_operand` of the fake-quantized q: operand and
    weights bit for bit, whether q arrives fake-quantized or raw (the kernel quantizes it the same way), with heads
    spanning 1e-3..300 and channels within a head spanning 100x (so the 32-channel groups get different scales); 8
    and 96 heads are padded inside to 16 / 128 with zero heads."""
    from pallas_kernels.indexer.gpu_mosaic import fp4_q_operand

    rng = np.random.default_rng(R * 10 + H + fake)
    q = jnp.asarray(rng.standard_normal((R, H, 128)) * rng.choice([1e-3, 1.0, 300.0], (R, H, 1))
                    * rng.choice([1e-2, 1.0], (R, H, 128)), jnp.float32)
    fq = F.fake_quantize(q, "fp4")
    w = jnp.asarray(rng.standard_normal((R, H)), jnp.float32)
    columns = _fp4_columns()
    got_q, got_w = q_prep.q_prep_fp4(fq if fake else q, w, q_prep.column_permutation(columns), interpret=True)
    want_q, want_w = fp4_q_operand(fq, w, columns)
    assert got_q.dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(got_q, np.float32), np.asarray(want_q, np.float32))
    np.testing.assert_array_equal(np.asarray(got_w), np.asarray(want_w))


@pytest.mark.parametrize("R,H,fake,rows", [(3, 64, True, False), (3, 64, False, False), (2, 8, False, False),
                                           full(2, 96, False, False), (3, 64, False, True), (2, 40, True, True)])
def test_q_prep_fp4_e5m2_equals_the_jnp_path(R, H, fake, rows):
    """precision "fp8" (session 45): the kernel's e5m2 operand and weights (Pallas interpreter) equal
    `gpu_mosaic.fp4_q_operand_e5m2` bit for bit, from a raw or a fake-quantized q, heads 1e-3..300 apart and groups
    within a head 100x apart; its shift is gpu's. rows: the converter's rows layout (channels in their order), where
    the kernel takes perm=None and runs no permutation MMA; 40 heads are padded to 3 blocks of 16."""
    from pallas_kernels.indexer import gpu
    from pallas_kernels.indexer.gpu_mosaic import fp4_q_operand_e5m2
    from pallas_kernels.indexer.mosaic_fp4 import register_plan

    assert q_prep.FP4_Q_SHIFT == gpu.FP4_Q_SHIFT
    rng = np.random.default_rng(R * 100 + H + fake)
    q = jnp.asarray(rng.standard_normal((R, H, 128)) * rng.choice([1e-3, 1.0, 300.0], (R, H, 1))
                    * rng.choice([1e-2, 1.0], (R, H, 128)), jnp.float32)
    fq = F.fake_quantize(q, "fp4")
    w = jnp.asarray(rng.standard_normal((R, H)), jnp.float32)
    columns = np.arange(128) if rows else register_plan(64, "e5m2")[1]
    got_q, got_w = q_prep.q_prep_fp4(fq if fake else q, w, None if rows else q_prep.column_permutation(columns),
                                     e5m2=True, interpret=True)
    want_q, want_w = fp4_q_operand_e5m2(q, w, columns)
    assert got_q.dtype == jnp.float8_e5m2 == want_q.dtype
    np.testing.assert_array_equal(np.asarray(got_q, np.float32), np.asarray(want_q, np.float32))
    np.testing.assert_array_equal(np.asarray(got_w), np.asarray(want_w))


def test_q_prep_fp4_errors():
    perm = q_prep.column_permutation(_fp4_columns())
    with pytest.raises(ValueError, match="power of two"):
        q_prep.q_prep_fp4(jnp.zeros((2, 16, 96)), jnp.zeros((2, 16)), q_prep.column_permutation(np.arange(96)),
                          interpret=True)
    with pytest.raises(ValueError, match="perm"):
        q_prep.q_prep_fp4(jnp.zeros((2, 64, 128)), jnp.zeros((2, 64)), perm[:64], interpret=True)
    with pytest.raises(ValueError, match="not a permutation"):
        q_prep.column_permutation(np.zeros(128, np.int32))


@pytest.mark.parametrize("topk", ["segment_set", "tour_set"])
def test_fp4_mosaic_with_q_prep_lowers(topk, monkeypatch):
    """fp4 keys on the Mosaic kernel with q_prep "triton" lower for CUDA, q prepared by its own Triton kernel."""
    from test_gpu_lowering import lowers_for
    from test_indexer_segment_select import _abstract_inputs

    from pallas_kernels.indexer import gpu_mosaic
    from pallas_kernels.indexer.gpu import indexer_topk_gpu

    monkeypatch.setitem(gpu_mosaic.MOSAIC_CONFIG, "q_prep", "triton")
    text = lowers_for("cuda", "mosaic_gpu", lambda *a: indexer_topk_gpu(*a, k=512, topk=topk, kernel="mosaic"),
                      *_abstract_inputs(64, 32768, "fp4"))
    assert "indexer_q_prep_fp4" in text
    text = lowers_for("cuda", "mosaic_gpu", lambda *a: indexer_topk_gpu(*a, k=512, topk=topk, kernel="mosaic",
                                                                       precision="fp8"),
                      *_abstract_inputs(64, 32768, "fp4"))
    assert "indexer_q_prep_fp4_e5m2" in text


@pytest.mark.parametrize("fmt", ["fp8", "fp4", "bf16"])
@pytest.mark.parametrize("impl,opts", [("reference", {}), ("pallas", {}), ("pallas", dict(picks="set"))])
def test_quantize_q_equals_fake_quantized_q(fmt, impl, opts):
    """indexer_topk / indexer_scores_pallas with quantize_q=True and a raw q give what a fake-quantized q gives
    without it (the reference's contract) on the reference and the Triton kernel (the interpreter: "pallas" on the CPU),
    both pick orders."""
    from test_indexer_kernels import make

    from pallas_kernels.indexer import indexer_scores_pallas, indexer_topk

    q, w, keys, nv = make(2, 1, 16, 200, fmt, True)
    raw = F.hadamard(jnp.asarray(np.random.default_rng(5).standard_normal(q.shape), jnp.float32))
    fq = F.fake_quantize(raw, fmt if fmt != "bf16" else None)
    got = indexer_topk(raw, w, keys, nv, k=64, impl=impl, quantize_q=True, **opts)
    want = indexer_topk(fq, w, keys, nv, k=64, impl=impl, **opts)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    if impl == "pallas" and not opts:
        np.testing.assert_array_equal(np.asarray(indexer_scores_pallas(raw, w, keys, nv, impl=impl, quantize_q=True)),
                                      np.asarray(indexer_scores_pallas(fq, w, keys, nv, impl=impl)))


def test_prepare_q_skips_only_where_the_kernel_quantizes(monkeypatch):
    """`prepare_q` leaves q raw exactly where the Mosaic kernel quantizes it itself: fp8 keys, and fp4 keys with
    q_prep "triton" or precision "fp8" (their default); it fake-quantizes for the reference, the Triton kernel and
    the other Mosaic fp4 preparation (precision "f16", q_prep "xla"), and leaves bf16 keys' q alone."""
    from test_indexer_kernels import make

    from pallas_kernels.indexer import gpu_mosaic, prepare_q

    for fmt in ("fp8", "fp4", "bf16"):
        q, _, keys, _ = make(2, 1, 16, 200, fmt)
        raw = q + 0.01   # not representable in either format
        for target, opts, prep, skips in [("reference", {}, "xla", False), ("interpret", {}, "xla", False),
                                          # fp4 keys at precision "fp8" (session 45; their default since
                                          # session 46) fake-quantize q themselves, at "f16" with q_prep triton
                                          ("interpret", dict(kernel="mosaic"), "xla", fmt in ("fp8", "fp4")),
                                          ("interpret", dict(kernel="mosaic", precision="f16"), "xla", fmt == "fp8"),
                                          ("interpret", dict(kernel="mosaic", precision="f16"), "triton", True),
                                          ("interpret", dict(kernel="mosaic"), "triton", True),
                                          ("interpret", dict(kernel="mosaic", precision="fp8"), "xla",
                                           fmt in ("fp8", "fp4"))]:
            monkeypatch.setitem(gpu_mosaic.MOSAIC_CONFIG, "q_prep", prep)
            got = np.asarray(prepare_q(raw, keys, target, opts))
            want = raw if skips or fmt == "bf16" else F.fake_quantize(raw, fmt)
            np.testing.assert_array_equal(got, np.asarray(want), err_msg=f"{fmt} {target} {opts} {prep}")


@full_tier   # ~25 s in the GPU interpreter
def test_mosaic_fp8_interpreted_takes_raw_q():
    """The Mosaic kernel over fp8 keys (Pallas' GPU interpreter): a raw q with quantize_q=True scores bit for bit
    as its fake-quantized q (the kernel's own quantization of either gives the same values)."""
    if ON_GPU:
        pytest.skip("CPU interpreter test (test_gpu_quantize_q_on_mosaic on the GPU)")
    pytest.importorskip("jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call")
    from test_indexer_kernels import make

    from pallas_kernels.indexer import indexer_scores_pallas

    _, w, keys, nv = make(3, 1, 16, 776, "fp8", True)
    raw = jnp.asarray(np.random.default_rng(9).standard_normal((3, 1, 16, 128)), jnp.float32)
    opts = dict(impl="pallas", kernel="mosaic", precision="fp8", num_splits=2, num_stages=2)
    got = indexer_scores_pallas(raw, w, keys, nv, quantize_q=True, **opts)
    want = indexer_scores_pallas(F.fake_quantize(raw, "fp8"), w, keys, nv, **opts)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU (compiled Mosaic and Triton kernels)")
@pytest.mark.parametrize("fmt,prep,B,H,T,topk", [("fp8", "xla", 64, 64, 32768, "auto_set"),
                                                  ("fp4", "triton", 64, 64, 32768, "auto_set"),
                                                  ("fp8", "triton", 20, 32, 8192, "tour_set"),
                                                  ("fp4", "xla", 20, 32, 8192, "tour_set")])
def test_gpu_quantize_q_on_mosaic(fmt, prep, B, H, T, topk, monkeypatch):
    """On the GPU: a raw q with quantize_q=True gives the Mosaic kernel's scores and picks of its fake-quantized q,
    bit for bit, with either q preparation (fp4 "triton": the kernel fake-quantizes; else the dispatcher does)."""
    from test_indexer_kernels import make

    from pallas_kernels.indexer import gpu_mosaic, indexer_scores_pallas, indexer_topk

    monkeypatch.setitem(gpu_mosaic.MOSAIC_CONFIG, "q_prep", prep)
    _, w, keys, nv = make(B, 1, H, T, fmt, True)
    raw = F.hadamard(jnp.asarray(np.random.default_rng(B + H).standard_normal((B, 1, H, 128)), jnp.float32))
    fq = F.fake_quantize(raw, fmt)
    runs = []
    for qq, quantize in ((raw, True), (fq, False)):
        scores = jax.jit(lambda *a: indexer_scores_pallas(*a, impl="pallas", kernel="mosaic",
                                                          quantize_q=quantize))(qq, w, keys, nv)
        picks = jax.jit(lambda *a: indexer_topk(*a, k=512, impl="pallas", picks="set", topk=topk, kernel="mosaic",
                                                quantize_q=quantize))(qq, w, keys, nv)
        runs.append((np.asarray(scores), np.asarray(picks)))
    np.testing.assert_array_equal(runs[0][0], runs[1][0])
    np.testing.assert_array_equal(runs[0][1], runs[1][1])


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU (compiled Mosaic and Triton kernels)")
@pytest.mark.parametrize("fmt", ["fp4", "fp8"])   # (the fp4 cases run the converter)
@pytest.mark.parametrize("B,H,T,quantize", [(64, 64, 32768, True), (16, 64, 32768, False), (3, 128, 20000, True),
                                            (5, 64, 1000, True)])
def test_gpu_fused_q_prep_converter(fmt, B, H, T, quantize, monkeypatch):
    """On the GPU: q_prep "fused" (session 76: the scorer makes its row's q operand and head weights from the raw q
    itself; fp4 keys through the converter, fp8 keys) gives the Triton q kernel's scores and segment top-k picks
    bit for bit, from a raw q (quantize_q) and a fake-quantized one."""
    from test_indexer_kernels import make

    from pallas_kernels.indexer import gpu_mosaic, indexer_scores_pallas, indexer_topk

    _, w, keys, nv = make(B, 1, H, T, fmt, True)
    raw = F.hadamard(jnp.asarray(np.random.default_rng(B + H).standard_normal((B, 1, H, 128)), jnp.float32))
    q = raw if quantize else F.fake_quantize(raw, fmt)
    runs = {}
    for prep in ("triton", "fused"):
        monkeypatch.setitem(gpu_mosaic.MOSAIC_CONFIG, "q_prep", prep)
        scores = jax.jit(lambda *a: indexer_scores_pallas(*a, impl="pallas", kernel="mosaic",
                                                          quantize_q=quantize))(q, w, keys, nv)
        picks = jax.jit(lambda *a: indexer_topk(*a, k=512, impl="pallas", picks="set", topk="auto_set",
                                                kernel="mosaic", quantize_q=quantize))(q, w, keys, nv)
        runs[prep] = (np.asarray(scores), np.asarray(picks))
    np.testing.assert_array_equal(runs["fused"][0], runs["triton"][0])
    np.testing.assert_array_equal(runs["fused"][1], runs["triton"][1])


def test_prepare_q_decides_per_query_chunk(monkeypatch):
    """The scores kernel is chosen per query chunk: 8 rows x 2 queries make 16 query rows (Mosaic's "auto" rule on a
    GPU) whole, but chunks of one query hold 8 (Triton), so q must arrive fake-quantized there."""
    from test_indexer_kernels import make

    from pallas_kernels.indexer import gpu_mosaic, prepare_q

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(gpu_mosaic, "AUTO", True)
    q, _, keys, _ = make(8, 2, 64, 256, "fp8")
    raw = q + 0.01
    np.testing.assert_array_equal(np.asarray(prepare_q(raw, keys, "gpu", {}, query_chunk=256)), np.asarray(raw))
    np.testing.assert_array_equal(np.asarray(prepare_q(raw, keys, "gpu", {}, query_chunk=1)),
                                  np.asarray(F.fake_quantize(raw, "fp8")))
