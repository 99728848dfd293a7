"""The FP4-weight grouped matmul (`pallas_kernels.grouped_matmul.fp4`): its layout against the checkpoint's FP4
format (`dsv4_jax.quant`), the kernel (Pallas interpreter on the CPU, compiled on a GPU) against the reference, its
errors, its CUDA lowering at V4-Flash shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4_jax import quant as Q
from pallas_kernels.grouped_matmul.fp4 import (DECODES, E2M1_PAIRS_ASM, Fp4Weights, dequantize, e2m1_bf16_bits,
                                               e2m1_pairs, from_checkpoint, grouped_matmul_fp4, grouped_matmul_fp4_gpu)

ON_GPU = jax.default_backend() == "gpu"


def _experts(rng, E, K, N, spread=True):
    """E random experts quantized as the checkpoint stores them ([out, in/2] int8 + [out, in/32] e8m0, `quant_fp4`),
    -> (Fp4Weights, the dequantized [E, K, N] f32 by `quant.dequant_fp4`). spread: scales 2^-12 .. 2^4 across
    blocks, so the e8m0 bytes differ."""
    packed, scales, dense = [], [], []
    for _ in range(E):
        w = rng.standard_normal((N, K)).astype(np.float32)
        if spread:
            w *= np.exp2(rng.integers(-12, 5, (N, K // 32))).repeat(32, axis=1)
        p, s = Q.quant_fp4(w)
        packed.append(p)
        scales.append(s)
        dense.append(Q.dequant_fp4(p, s).T)
    return from_checkpoint(np.stack(packed), np.stack(scales)), np.stack(dense)


def _case(rng, sizes, K, N, dtype, extra_rows=0):
    sizes = np.asarray(sizes, np.int32)
    lhs = jnp.asarray(rng.standard_normal((int(sizes.sum()) + extra_rows, K)), dtype)
    rhs, dense = _experts(rng, len(sizes), K, N)
    return lhs, rhs, jnp.asarray(sizes), dense


def test_layout_is_the_checkpoints_bytes():
    """`from_checkpoint` keeps the checkpoint's bytes, and `dequantize` of them == `quant.dequant_fp4` of every
    expert (as [in, out]), exactly;
    every nibble code, with e8m0 bytes from 3 to 250 and 255 (NaN), decodes as the checkpoint's decoder does. (Bytes
    0-2 scale 0.5 below 2^-126: XLA flushes such subnormal products to 0, numpy does not; no checkpoint holds them.)"""
    rng = np.random.default_rng(0)
    rhs, dense = _experts(rng, 3, 96, 40)
    np.testing.assert_array_equal(np.asarray(dequantize(rhs)), dense)
    codes = np.arange(256, dtype=np.uint8).reshape(1, 2, 128)            # N = 2, K = 256: every byte
    scales = np.array([[[3, 4, 250, 100, 127, 127, 127, 127], [255, 127, 130, 3, 127, 127, 127, 127]]], np.uint8)
    got = np.asarray(dequantize(Fp4Weights(jnp.asarray(codes), jnp.asarray(scales))))
    want = np.stack([Q.dequant_fp4(codes[0, n][None].view(np.int8), scales[0, n][None])[0]
                     for n in range(2)], axis=-1)
    np.testing.assert_array_equal(np.isnan(got[0]), np.isnan(want))
    np.testing.assert_array_equal(np.nan_to_num(got[0]), np.nan_to_num(want))


def test_e2m1_bits_and_the_pairs_asm_are_exact():
    """The kernel's unscaled decodes against `quant`'s FP4 table: `e2m1_bf16_bits` for all 16 codes, and the inline
    PTX `E2M1_PAIRS_ASM` (run by `tests/ptx_sim.py`) bit for bit against its interpreted twin `e2m1_pairs`:
    every byte value at each of the 4 byte positions of a register, around random other bytes, and random words."""
    from ptx_sim import run_registers

    codes = jnp.arange(16, dtype=jnp.int32)
    got = jax.lax.bitcast_convert_type(e2m1_bf16_bits(codes).astype(jnp.uint16), jnp.bfloat16)
    want = Q.dequant_fp4(np.arange(16, dtype=np.uint8)[None].view(np.int8), np.array([[127]], np.uint8))
    want = np.concatenate([want[0, 0::2], want[0, 1::2]])                   # low nibbles 0-15, then high ones
    np.testing.assert_array_equal(np.asarray(got, np.float32), want[:16])
    assert np.signbit(np.asarray(got, np.float32)[8])                        # code 8 is -0
    rng = np.random.default_rng(3)
    words = [int(w) for w in rng.integers(0, 2 ** 32, 500, dtype=np.uint64)]
    words += [(int(rng.integers(0, 2 ** 32)) & ~(0xFF << 8 * i)) | (v << 8 * i) for i in range(4) for v in range(256)]
    data = np.array(words, np.uint32)
    want = np.asarray(e2m1_pairs(jnp.asarray(data.view(np.uint8)), interpret=True)).reshape(-1, 4)
    got = np.array([run_registers(E2M1_PAIRS_ASM, [w], 4) for w in words], np.uint32)
    np.testing.assert_array_equal(got, want.view(np.uint32))


@pytest.mark.parametrize("decode", DECODES)
@pytest.mark.parametrize("sizes,extra,opts,dtype", [([0, 5, 17, 0, 1, 30, 0, 3], 4, {}, jnp.bfloat16),
                                                    ([40], 0, dict(block_m=32, block_k=32), jnp.float32),
                                                    ([3, 0, 9], 2, dict(block_n=32, block_k=128), jnp.float32)])
def test_kernel_matches_reference(sizes, extra, opts, dtype, decode):
    """The kernel (interpreted on the CPU) == the reference (dequantize, cast to lhs's dtype, ragged dot): empty
    groups, group boundaries inside 16-row tiles, rows past the groups 0, 1-4 chunks per K step; bf16 and f32;
    each way of decoding (`DECODES`; "join" runs its asm's interpreted twin here)."""
    rng = np.random.default_rng(len(sizes))
    lhs, rhs, gs, dense = _case(rng, sizes, 128, 64, dtype, extra)
    want = np.asarray(grouped_matmul_fp4(lhs, rhs, gs, impl="reference"))
    got = np.asarray(grouped_matmul_fp4(lhs, rhs, gs, impl="pallas", decode=decode, **opts))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    if extra:
        assert np.all(got[-extra:] == 0)
    # and the reference is the dense product with the checkpoint's dequantized experts, group by group
    off = np.concatenate([[0], np.cumsum(sizes)])
    x = np.asarray(lhs.astype(jnp.float32))
    for e in range(len(sizes)):
        w = np.asarray(jnp.asarray(dense[e]).astype(dtype).astype(jnp.float32))
        np.testing.assert_allclose(want[off[e]:off[e + 1]], x[off[e]:off[e + 1]] @ w, rtol=1e-4,
                                   atol=1e-4 * np.abs(want).max() + 1e-30)


@pytest.mark.parametrize("sizes,extra,K,N,dtype,opts", [([0, 5, 17, 0, 1, 30, 0, 3], 4, 256, 128, jnp.bfloat16, {}),
                                                    ([40], 0, 512, 256, jnp.float32, dict(block_m=8)),
                                                    ([3, 0, 9], 2, 256, 256, jnp.float32, {}),
                                                    ([0, 0], 3, 256, 128, jnp.float32, {}),
                                                    ([4, 0, 7], 1, 2048, 128, jnp.bfloat16, {})])
def test_tpu_kernel_matches_reference(sizes, extra, K, N, dtype, opts):
    """The TPU kernel (`tpu.grouped_matmul_fp4_tpu`, in the TPU interpreter) == the reference: empty groups, group
    boundaries inside row tiles (items sharing a tile), rows past the groups 0, several N tiles, no rows at all, K
    in several FP4_K_CHUNK steps (K = 2048); bf16 and f32 (the latter in f32, as the contract's precision says)."""
    rng = np.random.default_rng(len(sizes) + K)
    lhs, rhs, gs, _ = _case(rng, sizes, K, N, dtype, extra)
    want = np.asarray(grouped_matmul_fp4(lhs, rhs, gs, impl="reference"))
    got = np.asarray(grouped_matmul_fp4(lhs, rhs, gs, impl="interpret_tpu", **opts))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max() + 1e-30)
    if extra:
        assert np.all(got[-extra:] == 0)


def test_tpu_kernel_dispatch_and_errors(monkeypatch):
    """impl "auto" on a TPU takes the FP4 TPU kernel where K is a multiple of 256 and N of 128, the reference
    elsewhere (small custom configs); "interpret_tpu" (and "pallas" on a TPU) with other shapes raises."""
    from pallas_kernels.grouped_matmul import fp4, tpu

    rng = np.random.default_rng(2)
    calls = []
    monkeypatch.setattr(fp4, "resolve_impl", lambda impl, *a, **kw: "tpu" if impl != "reference" else "reference")
    monkeypatch.setattr(tpu, "grouped_matmul_fp4_tpu", lambda *a, **kw: calls.append(kw) or "kernel")
    lhs, rhs, gs, _ = _case(rng, [3, 5], 256, 128, jnp.float32)
    assert grouped_matmul_fp4(lhs, rhs, gs, impl="auto") == "kernel"
    lhs, rhs, gs, _ = _case(rng, [3, 5], 64, 32, jnp.float32)
    want = np.asarray(grouped_matmul_fp4(lhs, rhs, gs, impl="reference"))
    np.testing.assert_array_equal(np.asarray(grouped_matmul_fp4(lhs, rhs, gs, impl="auto")), want)
    assert calls == [dict(interpret=False)]
    assert tpu.fp4_kernel_applies(4096, 2048) and tpu.fp4_kernel_applies(2048, 4096)
    assert not tpu.fp4_kernel_applies(64, 128) and not tpu.fp4_kernel_applies(256, 64)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="multiple of 256"):
        grouped_matmul_fp4(lhs, rhs, gs, impl="interpret_tpu")


def test_default_block_k():
    """128 inputs a K step for decode's 16-row tiles, 64 for prefill's wider ones (the GPU-checked config there),
    narrowed to a multiple of 32 dividing K."""
    from pallas_kernels.grouped_matmul.fp4 import default_block_k

    assert [default_block_k(16, K) for K in (4096, 2048, 96, 160, 64)] == [128, 128, 96, 32, 64]
    assert [default_block_k(64, K) for K in (4096, 96, 32)] == [64, 32, 32]


def test_errors():
    rng = np.random.default_rng(1)
    lhs, rhs, gs, _ = _case(rng, [3, 5], 64, 32, jnp.float32)
    with pytest.raises(ValueError, match="lhs \\[M, K = 64\\]"):
        grouped_matmul_fp4_gpu(lhs[:, :32], rhs, gs, interpret=True)
    with pytest.raises(ValueError, match="multiple of 32"):
        grouped_matmul_fp4_gpu(lhs, rhs, gs, block_k=48, interpret=True)
    with pytest.raises(ValueError, match="scales"):
        grouped_matmul_fp4(lhs, Fp4Weights(rhs.packed, rhs.scales[:, :1]), gs)
    with pytest.raises(ValueError, match="uint8"):
        grouped_matmul_fp4(lhs, Fp4Weights(rhs.packed.astype(jnp.int32), rhs.scales), gs)
    with pytest.raises(TypeError, match="Fp4Weights"):
        grouped_matmul_fp4(lhs, dequantize(rhs), gs)
    with pytest.raises(ValueError, match="decode must be one of"):
        grouped_matmul_fp4_gpu(lhs, rhs, gs, decode="lut", interpret=True)
    probe = grouped_matmul_fp4_gpu(lhs, rhs, gs, decode="raw", interpret=True)   # timing probe: runs, wrong values
    assert probe.shape == (lhs.shape[0], 32) and np.isfinite(np.asarray(probe)).all()
    with pytest.raises(ValueError, match="apply to the kernels only"):
        grouped_matmul_fp4(lhs, rhs, gs, impl="reference", block_m=32)


def test_fp4_grouped_matmul_lowers_for_cuda():
    """The kernel lowers for CUDA at V4-Flash's decode shapes (96 token x expert rows over 256 experts; w1 / w3
    4096 -> 2048, w2 2048 -> 4096) and at a prefill-like one."""
    from test_gpu_lowering import lowers_for

    sds = jax.ShapeDtypeStruct
    for M, K, N, opts in [(96, 4096, 2048, {}), (96, 2048, 4096, dict(decode="join_t")),
                          (96, 4096, 2048, dict(decode="f32")),
                          (4096, 4096, 2048, dict(block_m=64)), (4096, 4096, 2048, {})]:
        rhs = Fp4Weights(sds((256, N, K // 2), jnp.uint8), sds((256, N, K // 32), jnp.uint8))
        text = lowers_for("cuda", "triton", lambda x, r, g: grouped_matmul_fp4_gpu(x, r, g, **opts),
                          sds((M, K), jnp.bfloat16), rhs, sds((256,), jnp.int32))
        assert "grouped_matmul_fp4" in text
        if M == 4096 and not opts:   # prefill's default tile: 32 rows (session 48), 64 inputs a K step
            assert "grouped_matmul_fp4_join_m32_n128_k64" in text


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU (the compiled Triton kernel)")
@pytest.mark.parametrize("T,E,opts", [(16, 256, {}), (64, 256, {}), (512, 64, dict(block_m=64)), (512, 256, {}),
                                      (16, 256, dict(decode="f32")), (16, 256, dict(block_k=64, num_warps=8)),
                                      (16, 256, dict(block_n=256, num_warps=8)), (16, 256, dict(decode="join_t")),
                                      (64, 256, dict(decode="join_t", num_warps=2, block_n=64)),
                                      (16, 256, dict(decode="join_t", num_warps=2, block_n=64, block_k=64))])
def test_gpu_fp4_grouped_matmul_v4_flash_shapes(T, E, opts):
    """Compiled, V4-Flash expert shapes, top-6 routing of T tokens over E experts, random FP4 bytes: the kernel
    against the reference's math (each active expert dequantized to lhs's dtype, its rows' product in f32), w1-like
    and w2-like. One expert at a time: XLA's ragged dot over the dequantized experts needs 1-8 GB a call (its operand
    is masked per expert), which ran out of memory with 4 pytest workers on one 80 GB GPU (session 48)."""
    rng = np.random.default_rng(T + E)
    flat = np.sort(np.concatenate([rng.choice(E, 6, replace=False) for _ in range(T)]))
    sizes = np.bincount(flat, minlength=E)
    active = np.flatnonzero(sizes)
    gs = jnp.asarray(sizes, jnp.int32)
    for K, N in ((4096, 2048), (2048, 4096)):
        lhs = jnp.asarray(rng.standard_normal((6 * T, K)), jnp.bfloat16)
        rhs = Fp4Weights(jnp.asarray(rng.integers(0, 256, (E, N, K // 2)), jnp.uint8),
                         jnp.asarray(rng.integers(118, 125, (E, N, K // 32)), jnp.uint8))
        bounds = np.concatenate([[0], np.cumsum(sizes)])
        want = np.concatenate([np.asarray(jnp.dot(
            lhs[bounds[e]:bounds[e + 1]], dequantize(Fp4Weights(rhs.packed[e:e + 1], rhs.scales[e:e + 1]),
                                                     lhs.dtype)[0],
            preferred_element_type=jnp.float32)) for e in active])
        got = np.asarray(grouped_matmul_fp4(lhs, rhs, gs, impl="pallas", **opts))
        np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3 * np.abs(want).max())


@pytest.mark.parametrize("gmm_impl", ["reference", "pallas"])
def test_routed_experts_on_fp4_weights_equal_the_dequantized_model_path(gmm_impl):
    """`layers.moe.routed_experts` with Fp4Weights (the reference dequantizing them, or the kernel, interpreted)
    equals it with the experts dequantized to f32 as the model's loader does: routing with empty and shared
    experts."""
    from dsv4_jax.layers.moe import routed_experts

    rng = np.random.default_rng(12)
    T, k, E, D, I = 10, 3, 8, 64, 96
    x = jnp.asarray(rng.standard_normal((T, D)), jnp.float32)
    experts = jnp.asarray(np.stack([rng.choice(6, k, replace=False) for _ in range(T)]), jnp.int32)  # 6, 7 unused
    weights = jnp.asarray(rng.random((T, k)), jnp.float32)
    (w1, d1), (w3, d3), (w2, d2) = (_experts(rng, E, K, N, spread=False) for K, N in ((D, I), (D, I), (I, D)))
    want = routed_experts(x, weights, experts, *(jnp.asarray(d) for d in (d1, d3, d2)), 10.0, gmm_impl="reference")
    got = routed_experts(x, weights, experts, w1, w3, w2, 10.0, gmm_impl=gmm_impl)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_model_with_random_fp4_experts():
    """`DeepseekV4ForCausalLM(expert_weights="fp4")` on random weights (benchmarks' presets): uint8 expert stacks
    [E, out, in/2] / [E, out, in/32], values of about the dequantized init's scale, finite logits; bad values and
    dims that are no multiple of 32 are refused."""
    from flax import nnx

    from dsv4_jax.config import tiny
    from dsv4_jax.model import DeepseekV4ForCausalLM

    cfg = tiny()
    m = DeepseekV4ForCausalLM(cfg, rngs=nnx.Rngs(0), expert_weights="fp4")
    ex = m.layers[1].ffn.experts
    E, D, I = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    assert ex.w1_fp4[...].shape == (E, I, D // 2) and ex.w2_fp4_scale[...].shape == (E, D, I // 32)
    w1 = np.asarray(dequantize(Fp4Weights(ex.w1_fp4[...], ex.w1_fp4_scale[...])))
    assert 0.5 * D ** -0.5 < w1.std() < 2 * D ** -0.5
    assert np.isfinite(np.asarray(m(jnp.asarray([[1, 2, 3, 4, 5]])))).all()
    with pytest.raises(ValueError, match="expert_weights must be one of"):
        DeepseekV4ForCausalLM(cfg, rngs=nnx.Rngs(0), expert_weights="int8")
    with pytest.raises(ValueError, match="multiples of 32"):
        DeepseekV4ForCausalLM(cfg.replace(moe_intermediate_size=48), rngs=nnx.Rngs(0), expert_weights="fp4")


def test_model_logits_on_the_fp4_kernel_equal_the_reference(monkeypatch):
    """A tiny model with FP4 experts: prefill and decode logits with the routed experts on the FP4 kernel
    (interpreted on the CPU, compiled on a GPU) equal those on the reference (dequantize + ragged dot): to 1e-5 of
    their scale on the CPU, 2e-3 on a GPU. There the kernel and XLA sum the f32 products in different orders (the
    routed-expert test above holds them to 1e-5), and the random tiny model amplifies that through its layers and
    its experts' top-k (session 47, H100: max difference 3.3e-4 of the logits' scale)."""
    from flax import nnx

    import pallas_kernels.grouped_matmul.fp4 as fp4_module
    from dsv4_jax import model as model_module
    from dsv4_jax.config import tiny
    from dsv4_jax.layers import moe
    from dsv4_jax.model import DeepseekV4ForCausalLM

    cfg = tiny()
    m = DeepseekV4ForCausalLM(cfg, rngs=nnx.Rngs(1), expert_weights="fp4")
    ids = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 12)), jnp.int32)
    calls = []
    kernel = fp4_module.grouped_matmul_fp4_gpu
    monkeypatch.setattr(fp4_module, "grouped_matmul_fp4_gpu", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    outs = []
    for impl in ("reference", "pallas"):
        monkeypatch.setitem(moe.EXPERTS_CONFIG, "grouped_matmul", impl)
        model_module._jitted_chunk_impl.clear_cache()   # EXPERTS_CONFIG is read when the step is traced
        cache = m.init_cache(2, 16)
        logits, cache = m.prefill(ids[:, :10], cache)
        step, _ = m.decode(ids[:, 10], cache)
        outs.append((np.asarray(logits), np.asarray(step)))
        assert bool(calls) == (impl == "pallas"), "the FP4 kernel ran where it should not, or did not run"
    tol = 2e-3 if ON_GPU else 1e-5
    for a, b in zip(*outs):
        np.testing.assert_allclose(b, a, rtol=tol, atol=tol * np.abs(a).max())
