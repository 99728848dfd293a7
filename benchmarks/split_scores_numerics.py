"""Numerics of the Mosaic attention kernel's `split_scores` path, emulated on the CPU (no GPU needed).

Session 12: on the H200, split_scores=True passed the kernel tests (errors 2.7-3.0e-3 vs the default's 1.3-2.6e-3)
but a 64-head bf16 tiny model on it missed the model-level check (max logit error 0.113 vs the Triton kernel's
0.0074). Is that the arithmetic the path is designed to do, or a kernel bug? This script replays the kernel's
per-block arithmetic in jnp, in the kernel's order and precisions, for three schedules:

  default      both consumers score all bk entries; running max m = the exact row max; P = 2^(s - m) in f32,
               l += sum(P) in f32, P rounded to bf16 for P.V (the largest entry of a block is exactly 1.0)
  ss           `split_scores` as built: each consumer scores its bk/2 entries with its own integer max
               m_c = max(m, round(max_c)); P_c rounded to bf16 and rescaled by 2^(m_c - m_new) (exact); each
               consumer's l sums its f32 P_c; m starts at round(sink)
  ss_lbf16     the same, but l sums the bf16-rounded P_c that P.V uses (numerator and denominator consistent)

and reports (1) kernel-level relative errors against a float64 reference on random inputs (the GPU tests'
`make_inputs`) and on peaky ones, (2) the tiny model's logits (the GPU test's configuration) with the emulator in
place of the attention op, against the reference path.

    PYTHONPATH=.:tests python benchmarks/split_scores_numerics.py
"""

from __future__ import annotations

import math
import sys

import jax
import jax.numpy as jnp
import numpy as np

LOG2E = math.log2(math.e)
BK = 64   # the kernel's default block_k


def _bf16(x):
    return x.astype(jnp.bfloat16).astype(jnp.float32)


def _source_blocks(pool, idx, length, bk):
    """-> (rows [B,T,Kp,D] bf16 values as f32, valid [B,T,Kp]) padded to a multiple of bk (the kernel's flatten)."""
    k = idx.shape[-1]
    kp = -(-k // bk) * bk
    idx = jnp.pad(idx, ((0, 0), (0, 0), (0, kp - k)), constant_values=-1)
    valid = (idx >= 0) & (idx < pool.shape[0])
    if length is not None:
        valid &= jnp.arange(kp)[None, None, :] < jnp.clip(length, 0, k)[..., None]
    rows = jnp.take(pool.astype(jnp.float32), jnp.where(valid, idx, 0), axis=0)
    return rows, valid


def emulate(q, window_kv, window_idx, compressed_kv, compressed_idx, sinks, *, scale, window_len=None,
            compressed_len=None, mode="default", bk=BK, out_dtype=None, **_ignored):
    """The kernel's arithmetic for q [B,T,H,D] bf16 over bf16 pools (one split); returns o [B,T,H,D]."""
    srcs = [_source_blocks(window_kv, window_idx, window_len, bk)]
    if compressed_kv is not None:
        srcs.append(_source_blocks(compressed_kv, compressed_idx, compressed_len, bk))
    rows = jnp.concatenate([r for r, _ in srcs], axis=2)      # window blocks first, then compressed (kernel order)
    valid = jnp.concatenate([v for _, v in srcs], axis=2)
    qf = q.astype(jnp.float32)
    B, T, H, D = q.shape
    sink2 = sinks.astype(jnp.float32) * LOG2E
    split = mode != "default"
    m = jnp.broadcast_to(jnp.round(sink2) if split else sink2, (B, T, H))
    l = [jnp.zeros((B, T, H))] * (2 if split else 1)
    acc = jnp.zeros((B, T, H, D))
    hi = jax.lax.Precision.HIGHEST
    for j in range(rows.shape[2] // bk):
        kv = rows[:, :, j * bk:(j + 1) * bk]                  # [B,T,bk,D]
        s = jnp.einsum("bthd,btkd->bthk", qf, kv, precision=hi) * (scale * LOG2E)
        s = jnp.where(valid[:, :, None, j * bk:(j + 1) * bk], s, -jnp.inf)
        if not split:
            m_new = jnp.maximum(m, s.max(-1))
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(s - m_new[..., None])
            l = [l[0] * alpha + p.sum(-1)]
            p = _bf16(p)
        else:
            halves = [s[..., :bk // 2], s[..., bk // 2:]]
            m_c = [jnp.maximum(m, jnp.round(h.max(-1))) for h in halves]
            p_c = [jnp.exp2(h - mc[..., None]) for h, mc in zip(halves, m_c)]
            m_new = jnp.maximum(m_c[0], m_c[1])
            alpha = jnp.exp2(m - m_new)
            l_terms = [_bf16(pc) if mode == "ss_lbf16" else pc for pc in p_c]
            l = [lc * alpha + lt.sum(-1) * jnp.exp2(mc - m_new) for lc, lt, mc in zip(l, l_terms, m_c)]
            p = jnp.concatenate([_bf16(_bf16(pc) * jnp.exp2(mc - m_new)[..., None]) for pc, mc in zip(p_c, m_c)],
                                axis=-1)
        acc = acc * alpha[..., None] + jnp.einsum("bthk,btkd->bthd", p, kv, precision=hi)
        m = m_new
    l_tot = sum(l)
    o = acc / (l_tot + jnp.exp2(sink2 - m))[..., None]
    return o.astype(out_dtype or q.dtype)


def reference64(inp):
    """float64 reference of the op on the same inputs: o [B,T,H,D]. The gathered rows are the emulator's own
    (`_source_blocks` with 1-entry blocks: the same masking, bf16 values exact in f32), the arithmetic float64."""
    names = (("window_kv", "window_idx", "window_len"), ("compressed_kv", "compressed_idx", "compressed_len"))
    srcs = [_source_blocks(inp[p], inp[i], inp[n], 1) for p, i, n in names]
    rows = np.concatenate([np.asarray(r, np.float64) for r, _ in srcs], 2)
    valid = np.concatenate([np.asarray(v) for _, v in srcs], 2)
    q = np.asarray(inp["q"], np.float64)
    s = np.einsum("bthd,btkd->bthk", q, rows) * q.shape[-1] ** -0.5
    s = np.where(valid[:, :, None], s, -np.inf)
    sink = np.asarray(inp["sinks"], np.float64)[None, None, :]
    mx = np.maximum(s.max(-1), sink)
    e = np.exp(s - mx[..., None])
    return np.einsum("bthk,btkd->bthd", e, rows) / (e.sum(-1) + np.exp(sink - mx))[..., None]


def kernel_level():
    from test_sparse_attention import make_inputs

    print("kernel level: relative error vs float64 (||o - ref|| / ||ref||), bk = 64", flush=True)
    print(f"{'case':38s} {'default':>9s} {'ss':>9s} {'ss_lbf16':>9s}")
    cases = [("d512 decode K=128+512", (4, 1, 64, 512, 128, 300, 128, 512), 1.0),
             ("d128 prefill t=64 K=100+60", (1, 64, 64, 128, 512, 200, 100, 60), 1.0),
             ("d128 decode t=16 K=8+16", (2, 16, 64, 128, 64, 40, 8, 16), 1.0),
             ("d128 peaky (q x4) K=8+16", (2, 16, 64, 128, 64, 40, 8, 16), 4.0),
             ("d512 peaky (q x4) K=128+512", (4, 1, 64, 512, 128, 300, 128, 512), 4.0)]
    for name, args, qmul in cases:
        inp = make_inputs(*args, ragged=True)
        inp["q"] = (inp["q"].astype(jnp.float32) * qmul).astype(jnp.bfloat16)
        ref = reference64(inp)
        errs = []
        for mode in ("default", "ss", "ss_lbf16"):
            o = np.asarray(emulate(inp["q"], inp["window_kv"], inp["window_idx"], inp["compressed_kv"],
                                   inp["compressed_idx"], inp["sinks"], scale=args[3] ** -0.5,
                                   window_len=inp["window_len"], compressed_len=inp["compressed_len"], mode=mode),
                           np.float64)
            errs.append(np.linalg.norm(o - ref) / np.linalg.norm(ref))
        print(f"{name:38s} " + " ".join(f"{e:9.2e}" for e in errs), flush=True)


def model_level():
    """The GPU test `test_bf16_model_on_mosaic_attention_matches_triton_and_reference`, with the emulator as the
    attention op (its error measure: max |logit diff| / max |ref logit| over prefill and two decode steps)."""
    from flax import nnx

    import dsv4_jax.layers.attention as attn
    from dsv4_jax.config import tiny
    from dsv4_jax.model import DeepseekV4ForCausalLM
    from test_model_pallas import _run

    cfg = tiny(ratios=[4, 8], num_attention_heads=64, head_dim=128, qk_rope_head_dim=16, o_groups=8)
    ids = np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 18))
    make = lambda: DeepseekV4ForCausalLM(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(4), attention_impl="reference")
    ref = _run(make(), ids)
    rel = lambda a, b: max(np.abs(x.astype(np.float32) - y.astype(np.float32)).max()
                           / np.abs(y.astype(np.float32)).max() for x, y in zip(a, b))
    original = attn.sparse_attention
    print("model level (tiny bf16 model, 64 heads, head_dim 128, ratios [4, 8]): max logit error vs reference",
          flush=True)
    try:
        for mode in ("default", "ss", "ss_lbf16"):
            attn.sparse_attention = lambda *a, mode=mode, **kw: emulate(*a, mode=mode, **kw)
            jax.clear_caches()   # the model's jitted steps were traced with the previous op
            print(f"  {mode:9s} {rel(_run(make(), ids), ref):.4f}", flush=True)
    finally:
        attn.sparse_attention = original


if __name__ == "__main__":
    sys.path[:0] = [".", "tests"]
    jax.config.update("jax_platforms", "cpu")
    kernel_level()
    model_level()
