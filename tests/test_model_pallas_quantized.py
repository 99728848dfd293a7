"""Quantized cache mode with attention_impl="pallas" equals the reference path's own quantized mode (issue #4/#5)."""

import jax
import numpy as np
import pytest
from flax import nnx

from dsv4_jax.config import tiny
from dsv4_jax.model import DeepseekV4ForCausalLM
from tiers import full_tier


@full_tier   # the GPU runs it every session; CI covers each quantized kernel alone and the quantized reference model
@jax.default_matmul_precision("highest")
def test_pallas_model_matches_reference_in_quantized_cache_mode():
    """FP8 KV rows (584 B) + FP4 rotated indexer keys: the kernels read the same stored bytes as the reference. A CSA
    and an HCA layer (every quantized cache; a sliding-only layer adds none, test_model_pallas has one)."""
    cfg = tiny(ratios=[4, 8], head_dim=512, qk_rope_head_dim=64, index_head_dim=64)
    models = [DeepseekV4ForCausalLM(cfg, rngs=nnx.Rngs(5), attention_impl=impl) for impl in ("reference", "pallas")]
    ids = np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 19))
    outs = []
    for m in models:
        cache = m.init_cache(2, 24, kv_dtype="fp8", indexer_dtype="fp4", indexer_rotate=True)
        logits, cache = m.prefill(ids[:, :17], cache)
        step, _ = m.decode(ids[:, 17], cache)
        outs.append((np.asarray(logits), np.asarray(step)))
    for ref, out in zip(outs[0], outs[1]):
        assert np.abs(out - ref).max() / np.abs(ref).max() <= 2e-4


@pytest.mark.skipif(jax.default_backend() not in ("gpu", "cuda"), reason="the Mosaic GPU kernel runs only on a GPU")
def test_fp8_cache_bf16_model_on_mosaic_attention_matches_triton_and_reference():
    """A bf16 model with 64 heads of 512 (the shape the Mosaic GPU kernel takes with FP8 pools, its default for them
    since session 19) on an FP8 KV cache: prefill and decode logits on each GPU attention kernel are as close to the
    reference path as the Triton kernel's. Hash routing in every MoE layer, as in the bf16 Mosaic model test (a
    learned router's near-ties turn bf16 rounding noise into logit jumps in this toy model)."""
    import jax.numpy as jnp

    cfg = tiny(ratios=[4, 8], num_attention_heads=64, head_dim=512, qk_rope_head_dim=64, o_groups=8,
               num_hash_layers=2, index_head_dim=64)
    ids = np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 19))
    outs = {}
    for impl, kernel in (("reference", "auto"), ("pallas", "triton"), ("pallas", "mosaic")):
        m = DeepseekV4ForCausalLM(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(6), attention_impl=impl,
                                  attention_kernel=kernel)
        cache = m.init_cache(2, 24, kv_dtype="fp8")
        logits, cache = m.prefill(ids[:, :17], cache)
        step, _ = m.decode(ids[:, 17], cache)
        outs[kernel if impl == "pallas" else impl] = [np.asarray(logits, np.float32), np.asarray(step, np.float32)]
    rel = lambda a, b: max(np.abs(x - y).max() / np.abs(y).max() for x, y in zip(a, b))
    err = {k: rel(o, outs["reference"]) for k, o in outs.items() if k != "reference"}
    print("max logit error against the reference path:", {k: round(float(v), 4) for k, v in err.items()})
    assert err["mosaic"] <= max(2 * err["triton"], 2e-2), err
    assert rel(outs["mosaic"], outs["triton"]) <= 2e-2, err


@pytest.mark.skipif(jax.default_backend() not in ("gpu", "cuda"), reason="the Mosaic GPU kernel runs only on a GPU")
@pytest.mark.parametrize("kernel,fmt", [("mosaic", "fp8"), ("triton", "fp8"), ("mosaic", "bf16"), ("mosaic", "fp4")])
@jax.default_matmul_precision("highest")
def test_fp8_indexer_keys_on_mosaic_kernel_match_reference(monkeypatch, kernel, fmt):
    """fp8 (and, since session 27, bf16; since session 31, fp4) indexer keys with index_head_dim 128 (V4's), batch 16: with kernel "mosaic"
    decode's indexer scores run on the Mosaic GPU kernel (kernel "auto", gpu_mosaic.AUTO on: the default), prefill's
    on Triton; with "triton" (AUTO off) on the Triton kernel everywhere. Logits equal the reference path's own
    quantized mode within 2e-4 relative.
    This failed on the H200 (session 20 with Mosaic, session 21 with Triton too) while XLA's GPU compiler dropped the
    indexer q's fake quantization; tests/test_indexer_formats.py::test_fake_quantize_rounds_inside_a_jitted_program
    guards that."""
    from pallas_kernels.indexer import gpu_mosaic

    monkeypatch.setattr(gpu_mosaic, "AUTO", kernel == "mosaic")
    calls = []
    real = gpu_mosaic.indexer_scores_mosaic
    monkeypatch.setattr(gpu_mosaic, "indexer_scores_mosaic", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    cfg = tiny(head_dim=512, qk_rope_head_dim=64, index_head_dim=128, index_topk=8)
    ids = np.random.default_rng(4).integers(0, cfg.vocab_size, (16, 40))
    outs = []
    for impl in ("reference", "pallas"):
        m = DeepseekV4ForCausalLM(cfg, rngs=nnx.Rngs(7), attention_impl=impl)
        cache = m.init_cache(16, 64, indexer_dtype=fmt, indexer_rotate=True)   # 16 indexer key slots
        logits, cache = m.prefill(ids[:, :36], cache)
        steps = []
        for t in range(36, 40):
            step, cache = m.decode(ids[:, t], cache)
            steps.append(np.asarray(step))
        outs.append([np.asarray(logits)] + steps)
    assert bool(calls) == (kernel == "mosaic"), "the indexer kernel was not the one asked for"
    for i, (ref, out) in enumerate(zip(outs[0], outs[1])):
        err = np.abs(out - ref).reshape(16, -1).max(-1) / np.abs(ref).max()
        assert err.max() <= 2e-4, f"output {i} (0 = prefill): rows {np.nonzero(err > 2e-4)[0].tolist()} off, " \
                                  f"max {err.max():.3g}"
