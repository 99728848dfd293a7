"""Lightning-indexer scoring and top-k selection — plain-jnp reference, the contract of the indexer kernels
(spec §3.8).

    score[b, s, t] = sum_h weights[b, s, h] * ReLU(q[b, s, h] . k[b, t])      for t < n_visible[b, s], else -inf
    picks[b, s]    = the k highest-scoring entries (ties -> lower index), -1 where fewer than k are visible

`q` arrives rotated / fake-quantized as the key format requires and `weights` already carry the
index_n_heads^-0.5 * index_head_dim^-0.5 scaling. Keys are the cache storage: a [B, T, dI] array or
`formats.QuantizedKeys` (fp8 / fp4), dequantized on the fly. Picks come sorted by descending score, so the valid
ones form a prefix. Queries are processed in chunks of `query_chunk` so memory stays O(chunk * H * T).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..chunking import map_query_chunks
from . import formats
from .common import validate


def indexer_scores(q, weights, keys, n_visible):
    """q [B, S, H, dI] f32, weights [B, S, H] f32, keys [B, T, dI] storage, n_visible [B, S] -> [B, S, T] f32."""
    validate(q, weights, keys, n_visible)
    return _scores(q, weights, keys, n_visible)


# jitted (inlined into a caller's jit), so that an eager call (a test's oracle, a notebook) is one program
@functools.partial(jax.jit, inline=True)
def _scores(q, weights, keys, n_visible):
    """`indexer_scores` on arguments already validated (indexer_topk's query chunks)."""
    k = formats.dequantize(keys, jnp.float32)
    logits = jnp.einsum("bshd,btd->bsht", q.astype(jnp.float32), k, precision=jax.lax.Precision.HIGHEST)
    s = jnp.einsum("bsht,bsh->bst", jax.nn.relu(logits), weights.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)
    visible = jnp.arange(k.shape[1])[None, None, :] < n_visible[..., None]
    return jnp.where(visible, s, -jnp.inf)


def indexer_topk(q, weights, keys, n_visible, *, k: int, query_chunk: int = 256):
    """-> picks [B, S, min(k, T)] int32 (entry indices, -1 = none), sorted by descending score."""
    validate(q, weights, keys, n_visible, k=k, query_chunk=query_chunk)
    return _topk(q, weights, keys, n_visible, min(k, keys.shape[1]), query_chunk)


@functools.partial(jax.jit, static_argnums=(4, 5), inline=True)
def _topk(q, weights, keys, n_visible, k, query_chunk):
    def select(args):
        qc, wc, nc = args
        vals, idx = jax.lax.top_k(_scores(qc, wc, keys, nc), k)
        return jnp.where(jnp.isfinite(vals), idx, -1).astype(jnp.int32)

    return map_query_chunks(select, (q, weights, n_visible), query_chunk)
