"""Sparse shared-KV MQA with an attention sink over two index-addressed KV pools — plain-jnp reference.

This is the contract the Pallas kernels implement (FlashMLA's `flash_mla_with_kvcache` with `indices`,
`extra_k_cache`/`extra_indices_in_kvcache` and `attn_sink` is the model; spec §3.9-3.10, §4.4):

* one KV head, K = V: a pool row is both the key and the value of an entry (head_dim D = 512 in V4);
* two sources: the window pool (sliding-window KV rows) and the compressed pool (compressed entries), each with
  its own per-query index list. Indices address **rows of a flat pool** (like FlashMLA's physical slot ids), not
  positions in one sequence: a per-sequence layout is `row = b * capacity + slot`; paged allocation only changes
  how indices are computed;
* `-1` (any negative index) means "no entry"; optional `*_len [B, T]` says only the first `len` entries of a
  list are used (entries past it are ignored whatever they hold);
* the per-head sink is a raw logit in the softmax denominator only (not multiplied by `scale`):

      l_i = scale * <q_h, kv[idx_i]>,    o_h = sum_i e^{l_i} kv[idx_i] / (sum_i e^{l_i} + e^{sink_h})

* a query with no valid entry at all gets o = 0 and lse = -inf (FlashMLA's convention);
* `lse` = log sum_i e^{l_i} over the valid entries of both sources, **without** the sink, so callers can merge
  partial results of split index lists and apply the sink once.

Duplicate indices count as separate entries (the op gathers, it does not deduplicate).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..chunking import map_query_chunks

from .fp8_layout import take_rows


def _gather_scores(q32, pool, idx, length, scale):
    """q32 [B,T,H,D] f32, pool [N,D], idx [B,T,K] -> (logits [B,T,H,K] f32 masked to -inf, rows [B,T,K,D] f32)."""
    n_rows = pool.shape[0]
    valid = (idx >= 0) & (idx < n_rows)
    if length is not None:
        valid &= jnp.arange(idx.shape[-1], dtype=jnp.int32)[None, None, :] < length[..., None]
    rows = take_rows(pool, jnp.where(valid, idx, 0), jnp.float32)  # plain array or Fp8KVPool (dequantized)
    logits = jnp.einsum("bthd,btkd->bthk", q32, rows, precision=jax.lax.Precision.HIGHEST) * scale
    logits = jnp.where(valid[:, :, None, :], logits, -jnp.inf)
    return logits, rows


def sparse_attention(
    q: jax.Array,
    window_kv: jax.Array,
    window_idx: jax.Array,
    compressed_kv: jax.Array | None,
    compressed_idx: jax.Array | None,
    sinks: jax.Array,
    *,
    scale: float,
    window_len: jax.Array | None = None,
    compressed_len: jax.Array | None = None,
    out_dtype=None,
    return_lse: bool = False,
    query_chunk: int = 256,
):
    """Gather-attention over window + compressed entries with a per-head sink.

    Args:
      q: [batch, queries, heads, head_dim] queries (any float dtype).
      window_kv: [n_window_rows, head_dim] flat window pool (K = V), or an `fp8_layout.Fp8KVPool` (spec §4.2
        FP8 rows, dequantized after the gather; the same applies to `compressed_kv`).
      window_idx: [batch, queries, k_window] int32 rows of `window_kv`; -1 = none.
      compressed_kv: [n_compressed_rows, head_dim] flat compressed pool, or None (sliding-only layers).
      compressed_idx: [batch, queries, k_compressed] int32 rows of `compressed_kv`; -1 = none; None with the pool.
      sinks: [heads] float32 sink logits.
      scale: softmax scale applied to q.k (head_dim ** -0.5 in V4).
      window_len, compressed_len: optional [batch, queries] int32 valid prefix length of each index list.
      out_dtype: output dtype (default q.dtype).
      return_lse: also return lse [batch, queries, heads] float32 (without the sink).
      query_chunk: queries processed at once (memory bound of the reference; no effect on results).

    Returns:
      o: [batch, queries, heads, head_dim] (and lse if `return_lse`).
    Out-of-range indices (>= pool rows) are treated as -1; nothing outside a pool is read.
    """
    return _sparse_attention(q, window_kv, window_idx, compressed_kv, compressed_idx, sinks, window_len,
                             compressed_len, scale, out_dtype=jnp.dtype(out_dtype or q.dtype), return_lse=return_lse,
                             query_chunk=query_chunk)


# Jitted (one program per shape and options; inlined into a caller's jit), so that an eager call is not a compile
# per jnp call. `scale` stays an argument (a traced scale works as before).
@functools.partial(jax.jit, static_argnames=("out_dtype", "return_lse", "query_chunk"), inline=True)
def _sparse_attention(q, window_kv, window_idx, compressed_kv, compressed_idx, sinks, window_len, compressed_len,
                      scale, *, out_dtype, return_lse, query_chunk):
    def attend(chunk):  # one chunk of queries: [B, c, ...] slices of the per-query inputs
        qc, widx, cidx, wlen, clen = chunk
        q32 = qc.astype(jnp.float32)
        logits, rows = _gather_scores(q32, window_kv, widx, wlen, scale)
        if compressed_kv is not None:
            c_logits, c_rows = _gather_scores(q32, compressed_kv, cidx, clen, scale)
            logits = jnp.concatenate([logits, c_logits], axis=-1)
            rows = jnp.concatenate([rows, c_rows], axis=2)
        sink = sinks.astype(jnp.float32)[None, None, :]
        m = jnp.maximum(jnp.max(logits, axis=-1), sink)  # [B, c, H]; finite because the sink is
        p = jnp.exp(logits - m[..., None])
        denom_entries = jnp.sum(p, axis=-1)
        o = jnp.einsum("bthk,btkd->bthd", p, rows, precision=jax.lax.Precision.HIGHEST)
        o = (o / (denom_entries + jnp.exp(sink - m))[..., None]).astype(out_dtype)
        lse = jnp.where(denom_entries > 0, jnp.log(denom_entries) + m, -jnp.inf)
        return o, lse

    # Gathered rows are [B, c, K, D] float32: chunk the queries so a long prefill stays within memory.
    o, lse = map_query_chunks(attend, (q, window_idx, compressed_idx, window_len, compressed_len), query_chunk)
    return (o, lse) if return_lse else o


@functools.partial(jax.jit, inline=True)
def attention_probs(q, window_kv, window_idx, compressed_kv, compressed_idx, sinks, *, scale: float,
                    window_len=None, compressed_len=None):
    """The softmax of `sparse_attention`, split by where its mass goes (for study, not for speed: every gathered row
    is materialised in f32). Same arguments as `sparse_attention`.

    Returns (p_window [B, T, H, Kw], p_compressed [B, T, H, Kc] or None, p_sink [B, T, H]), float32: for each
    query and head, p_window.sum(-1) + p_compressed.sum(-1) + p_sink == 1, and the op's output is
    sum_i p_i kv[idx_i] over both lists (the sink takes its share of the mass and contributes no value).
    Invalid entries (-1, out of range, past the valid length) get 0."""
    q32 = q.astype(jnp.float32)
    logits, _ = _gather_scores(q32, window_kv, window_idx, window_len, scale)
    kw = logits.shape[-1]
    if compressed_kv is not None:
        c_logits, _ = _gather_scores(q32, compressed_kv, compressed_idx, compressed_len, scale)
        logits = jnp.concatenate([logits, c_logits], axis=-1)
    sink = jnp.broadcast_to(sinks.astype(jnp.float32)[None, None, :], logits.shape[:-1])
    m = jnp.maximum(jnp.max(logits, axis=-1), sink)
    p = jnp.exp(logits - m[..., None])
    p_sink = jnp.exp(sink - m)
    denom = jnp.sum(p, axis=-1) + p_sink
    p, p_sink = p / denom[..., None], p_sink / denom
    return p[..., :kw], (p[..., kw:] if compressed_kv is not None else None), p_sink
