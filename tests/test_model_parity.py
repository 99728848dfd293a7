"""Whole-model parity with transformers' DeepseekV4ForCausalLM (float32, CPU), issue #2.

Several tiny random configs cover all three layer types in different orders, hash and learned routing, hc_mult 2
and 4, YaRN on and off, windows smaller than the sequence, index_topk smaller than the number of compressed
entries and sequences crossing several compression windows; batch > 1. Every parameter is random (the oracle's
init zeroes sinks, position biases, routing bias...). Checkpoints go through both on-disk layouts.
Tolerance: max |delta| / max |ref| <= 1e-4 at every position.
"""

import numpy as np
import pytest

import dsv4_jax
from dsv4_jax.config import tiny

import oracle as O

CASES = {
    "sliding-csa-hca": dict(ratios=[0, 4, 8]),
    "hca-csa-sliding/learned/hc2": dict(ratios=[8, 4, 0], num_hash_layers=0, hc_mult=2),
    "csa-hca16-csa/2hash/no-yarn": dict(ratios=[4, 16, 4], num_hash_layers=2, rope_scaling=None),
    "pro-order/hc4/3hash": dict(ratios=[8, 8, 4, 8, 0], num_hash_layers=3),
}
LAYOUTS = {"sliding-csa-hca": ("hf", "deepseek"), "pro-order/hc4/3hash": ("deepseek",)}


def rel_err_per_position(out, ref):
    return np.abs(out - ref).max(axis=(0, 2)) / np.abs(ref).max()


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_oracle(case, tmp_path):
    cfg = tiny(**CASES[case])
    hf = O.make_hf_model(cfg, seed=hash(case) % 1000)
    rng = np.random.default_rng(len(case))
    ids = rng.integers(0, cfg.vocab_size, (2, 41))
    for layout in LAYOUTS.get(case, ("hf",)):
        path = tmp_path / layout
        if layout == "hf":
            O.write_hf_layout(hf, path)
        else:  # FP8 / FP4 weights; the oracle now holds the dequantized values
            O.write_deepseek_layout(hf, cfg, path, quantize=True)
        model = dsv4_jax.load_pretrained(str(path), attention_impl="reference", progress=False)
        ref = O.hf_logits(hf, ids)
        out = np.asarray(model(ids))
        assert out.shape == ref.shape and out.dtype == np.float32
        err = rel_err_per_position(out, ref)
        assert err.max() <= 1e-4, f"{case} ({layout}): worst position {err.argmax()} rel err {err.max():.2e}"


def test_bfloat16_model_runs_close(tmp_path):
    """bf16 parameters: same code path, looser agreement (bf16 rounding), finite everywhere."""
    cfg = tiny()
    hf = O.make_hf_model(cfg, seed=7)
    O.write_hf_layout(hf, tmp_path)
    import jax.numpy as jnp
    model = dsv4_jax.load_pretrained(str(tmp_path), dtype=jnp.bfloat16, attention_impl="reference", progress=False)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 24))
    out = np.asarray(model(ids))
    ref = O.hf_logits(hf, ids)
    assert np.isfinite(out).all()
    assert np.abs(out - ref).max() / np.abs(ref).max() < 0.1
