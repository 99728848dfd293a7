"""Quantized cache mode with attention_impl="pallas" equals the reference path's own quantized mode (issue #4/#5)."""

import jax
import numpy as np
from flax import nnx

from dsv4_jax.config import tiny
from dsv4_jax.model import DeepseekV4ForCausalLM


@jax.default_matmul_precision("highest")
def test_pallas_model_matches_reference_in_quantized_cache_mode():
    """FP8 KV rows (584 B) + FP4 rotated indexer keys: the kernels read the same stored bytes as the reference."""
    cfg = tiny(head_dim=512, qk_rope_head_dim=64, index_head_dim=64)
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
