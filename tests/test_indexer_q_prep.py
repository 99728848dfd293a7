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
    np.testing.assert_array_equal(np.asarray(q_prep._scale_exponent(a)),
                                  np.asarray(F._pow2_exponent(a, F.E4M3_MAX, 1e-4)))


@pytest.mark.parametrize("R,H,fake,f16", [(5, 64, True, True), (3, 16, False, True), full(2, 128, True, True),
                                          (4, 32, True, False)])
def test_q_prep_kernel_equals_the_jnp_path(R, H, fake, f16):
    """The kernel (Pallas interpreter here) against `gpu.quantize_q_fp8` + the weights' scale + the f16 conversion:
    codes and weights bit for bit, for fake-quantized q (the contract) and raw q (rounded the same way), heads
    spanning 1e-3..300 in magnitude, the e4m3 codes themselves with f16=False (the kernel's precision "fp8")."""
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


def test_q_prep_errors():
    q, w = jnp.zeros((2, 48, 128)), jnp.zeros((2, 48))
    with pytest.raises(ValueError, match="powers of two"):
        q_prep.q_prep_fp8(q, w, interpret=True)
    with pytest.raises(ValueError, match="w must be"):
        q_prep.q_prep_fp8(jnp.zeros((2, 64, 128)), w, interpret=True)


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
    monkeypatch.setitem(gpu_mosaic.MOSAIC_CONFIG, "q_prep", "fused")
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
