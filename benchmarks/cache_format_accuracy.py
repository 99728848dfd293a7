"""Accuracy of the quantized cache formats against the exact cache on a tiny random model (issue #5, item 1).

    PYTHONPATH=. python benchmarks/cache_format_accuracy.py [--seq 256] [--out FILE]

Model: tiny DeepSeek-V4 architecture with the real attention widths where the formats need them (head_dim 512 =
448 + 64 so the 584-B FP8 KV rows apply; indexer 16 heads x 128 so the 132-B / 68-B key rows apply), layers
[sliding, CSA, HCA], random weights. For every format the model prefills the same random tokens and we report
  * logits: max |d| / max |exact| over all positions, the median over positions of the same per position, and the
    fraction of positions whose argmax token changed;
  * indexer top-k overlap: |picks_fmt & picks_exact| / |picks_exact| averaged over the queries of the CSA layer,
    with the layer's real input activations (the exact model's hidden states).
Random tiny models amplify perturbations (a flipped top-k pick or MoE route moves a logit by O(1)); the numbers
compare formats with each other, they do not predict a trained model's loss.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from dsv4_jax.cache import CompressorState  # noqa: E402
from dsv4_jax.config import tiny  # noqa: E402
from dsv4_jax.layers.hyper import hc_collapse, hc_weights  # noqa: E402
from dsv4_jax.model import DeepseekV4ForCausalLM  # noqa: E402
from pallas_kernels.indexer import formats  # noqa: E402

FORMATS = [  # (kv, indexer, rotate)
    ("bf16", None, False), ("fp8", None, False),
    (None, "bf16", False), (None, "fp8", False), (None, "fp8", True), (None, "fp4", False), (None, "fp4", True),
    ("fp8", "fp4", True),
]


def csa_input(model, ids):
    """Hidden input x [B, S, D] of the first CSA layer's attention in the exact model (runs the layers before it)."""
    cfg = model.config
    csa = cfg.layer_types.index("csa")
    B, S = ids.shape
    cache = model.init_cache(B, S)
    positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    start, n = jnp.zeros((B,), jnp.int32), jnp.full((B,), S, jnp.int32)
    streams = jnp.broadcast_to(model.embed(ids)[:, :, None], (B, S, cfg.hc_mult, cfg.hidden_size))
    for i in range(csa):
        streams, _ = model.layers[i](streams, ids, positions, start, n, cache.layers[i])
    blk = model.layers[csa]
    pre, _, _ = hc_weights(streams, blk.hc_attn_fn[...], blk.hc_attn_base[...], blk.hc_attn_scale[...],
                           **blk._hc_kwargs)
    return csa, blk.attn_norm(hc_collapse(streams, pre)), positions, start, n


def picks_for(attn, x, positions, start, n, fmt, rotate):
    B, S = x.shape[:2]
    cfg_dim = attn.indexer.head_dim
    cap = S // attn.ratio
    keys, _ = attn.indexer.compressor(x, positions, start, n, CompressorState.empty(B, attn.ratio, cfg_dim, True),
                                      formats.empty((B, cap, cfg_dim), fmt, x.dtype), key_format=fmt, rotate=rotate)
    qr = attn.q_norm(attn.wq_a(x))
    return np.asarray(attn.indexer.select(x, qr, positions, keys, fmt, rotate))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--topk", type=int, default=16)
    p.add_argument("--out")
    a = p.parse_args()
    cfg = tiny(head_dim=512, qk_rope_head_dim=64, index_head_dim=128, index_topk=a.topk, num_attention_heads=8,
               o_groups=2, hidden_size=128)
    model = DeepseekV4ForCausalLM(cfg, rngs=nnx.Rngs(0), attention_impl="reference")
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (a.batch, a.seq))
    exact, _ = model.prefill(ids, model.init_cache(a.batch, a.seq))
    exact = np.asarray(exact)
    csa, x, positions, start, n = csa_input(model, jnp.asarray(ids, jnp.int32))
    attn = model.layers[csa].attn
    ref_picks = picks_for(attn, x, positions, start, n, None, False)
    lines = [f"# {' '.join(sys.argv)}", f"# {cfg.summary()}",
             f"# jax {jax.__version__} on {jax.default_backend()}; batch {a.batch} x {a.seq} tokens; "
             f"CSA entries per row {a.seq // 4}, top-{min(a.topk, a.seq // 4)}",
             f"{'kv':>5} {'indexer':>8} {'rotate':>6} {'max|dlogit|/max':>16} {'median pos':>11} "
             f"{'argmax changed':>15} {'top-k overlap':>14}"]
    for kv, idx, rot in FORMATS:
        out, _ = model.prefill(ids, model.init_cache(a.batch, a.seq, kv_dtype=kv, indexer_dtype=idx,
                                                     indexer_rotate=rot))
        out = np.asarray(out)
        per_pos = np.abs(out - exact).max(-1) / np.abs(exact).max()     # [B, S]
        err, med = per_pos.max(), np.median(per_pos)
        flips = float(np.mean(out.argmax(-1) != exact.argmax(-1)))
        if idx is None:
            overlap = 1.0
        else:
            picks = picks_for(attn, x, positions, start, n, idx, rot)
            hits = [len(set(p[p >= 0]) & set(r[r >= 0])) / max(1, (r >= 0).sum())
                    for p, r in zip(picks.reshape(-1, picks.shape[-1]), ref_picks.reshape(-1, picks.shape[-1]))]
            overlap = float(np.mean(hits))
        lines.append(f"{str(kv):>5} {str(idx):>8} {str(rot):>6} {err:16.3e} {med:11.2e} {flips:15.3f} {overlap:14.3f}")
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
