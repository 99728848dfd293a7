"""Model logits with attention_impl="pallas" equal the reference path within 2e-4 relative (issue #4).

On CPU the Pallas kernel runs in the interpreter; on a GPU the real kernel runs (same test)."""

import jax
import numpy as np
import pytest
from flax import nnx

from dsv4_jax.config import tiny
from dsv4_jax.model import DeepseekV4ForCausalLM


@pytest.mark.parametrize("ratios", [[0, 4, 8]])
@jax.default_matmul_precision("highest")  # f32 everywhere (GPUs would use TF32 for the non-attention matmuls)
def test_pallas_model_matches_reference(ratios):
    cfg = tiny(ratios=ratios)
    models = [DeepseekV4ForCausalLM(cfg, rngs=nnx.Rngs(3), attention_impl=impl) for impl in ("reference", "pallas")]
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 18))
    outs = []
    for m in models:
        # prefill of 16 crosses the window (8) and every CSA (4) / HCA (8) emission up to position 15; then decode
        logits, cache = m.prefill(ids[:, :16], m.init_cache(2, 24))
        steps = []
        for t in (16, 17):
            step, cache = m.decode(ids[:, t], cache)
            steps.append(np.asarray(step))
        outs.append((np.asarray(logits), np.stack(steps)))
    for ref, out in zip(outs[0], outs[1]):
        assert np.abs(out - ref).max() / np.abs(ref).max() <= 2e-4
