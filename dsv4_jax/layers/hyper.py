"""Manifold-constrained hyper-connections (mHC, spec §3.2-3.3, §3.13).

The residual is `hc_mult` parallel streams X [B, S, hc, D]. Per sub-block (attention, FFN) a projection of the
RMS-normalised flattened streams gives pre [hc], post [hc] and comb [hc, hc] (Sinkhorn-projected towards a doubly
stochastic matrix). The sub-block sees y = sum_j pre_j X_j; its output f is mixed back as
X'_k = post_k f + sum_j comb[j, k] X_j. All mixing in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def hc_mixes(streams, fn, norm_eps):
    """streams [B, S, hc, D] -> mixes [B, S, rows(fn)] float32 = (rmsnorm(flatten(streams)) @ fn.T)."""
    flat = streams.reshape(streams.shape[:2] + (-1,)).astype(jnp.float32)
    flat = flat * jax.lax.rsqrt(jnp.mean(flat * flat, axis=-1, keepdims=True) + norm_eps)
    return jnp.einsum("bsi,ri->bsr", flat, fn.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)


def hc_weights(streams, fn, base, scale, *, hc: int, iters: int, eps: float, norm_eps: float):
    """-> pre [B, S, hc], post [B, S, hc], comb [B, S, hc, hc] (rows j = input stream, cols k = output stream)."""
    mixes = hc_mixes(streams, fn, norm_eps)
    pre = jax.nn.sigmoid(mixes[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2.0 * jax.nn.sigmoid(mixes[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    logits = (mixes[..., 2 * hc:] * scale[2] + base[2 * hc:]).reshape(mixes.shape[:2] + (hc, hc))
    comb = jax.nn.softmax(logits, axis=-1) + eps
    comb = comb / (jnp.sum(comb, axis=-2, keepdims=True) + eps)

    def sinkhorn_step(_, c):  # rows, then columns
        c = c / (jnp.sum(c, axis=-1, keepdims=True) + eps)
        return c / (jnp.sum(c, axis=-2, keepdims=True) + eps)

    # On CPU a rolled loop halves compile time; on accelerators unroll so XLA fuses the whole projection (a rolled
    # device loop costs a launch per iteration: ~20 per mHC site per step).
    comb = jax.lax.fori_loop(0, iters - 1, sinkhorn_step, comb, unroll=jax.default_backend() != "cpu")
    return pre, post, comb


def hc_collapse(streams, pre):
    """sum_j pre_j X_j in float32, cast to the stream dtype. streams [B, S, hc, D], pre [B, S, hc] -> [B, S, D]."""
    return jnp.sum(pre[..., None] * streams.astype(jnp.float32), axis=2).astype(streams.dtype)


def hc_expand(f, streams, post, comb):
    """X'_k = post_k f + sum_j comb[j, k] X_j (float32, cast back). f [B, S, D] -> [B, S, hc, D]."""
    mixed = jnp.einsum("bsjk,bsjd->bskd", comb, streams.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return (post[..., None] * f.astype(jnp.float32)[:, :, None, :] + mixed).astype(streams.dtype)


def hc_head_collapse(streams, fn, base, scale, *, eps: float, norm_eps: float):
    """Final collapse before the model norm: pre = sigmoid(mixes * scale + base) + eps; y = sum_j pre_j X_j."""
    pre = jax.nn.sigmoid(hc_mixes(streams, fn, norm_eps) * scale[0] + base) + eps
    return hc_collapse(streams, pre)
