"""Look inside the attention of a DeepSeek-V4 model: what each query sees, picks and weighs, layer by layer.

    logits, traces, cache = trace_attention(model, input_ids [B, S], cache=None, lengths=None)
    t = traces[layer]                               # AttentionTrace: the layer's attention inputs, as the op got them
    p_window, p_compressed, p_sink = t.probs()      # [B, S, H, Kw], [B, S, H, Kc] | None, [B, S, H]; sum to 1
    t.window_positions()                            # [B, S, Kw] token position of each window entry (-1 none)
    t.compressed_entries()                          # [B, S, Kc] compressed entry index of each list slot (-1 none)
    t.entry_span(w)                                 # token positions [first, last] that entry w pools
    t.indexer_scores()                              # CSA: [B, S, n_entries] the indexer's scores (-inf: not visible)
    t.output(impl="reference" | "pallas")           # the op's output on these inputs [B, S, H, head_dim]

`trace_attention` runs one chunk through the model exactly as `prefill` does (same function, `forward_chunk`, with
a list that each attention layer appends its inputs to), jitted, on whatever backend the model's kernels use. The
traces hold the sparse-attention op's arguments: q after RoPE, the flat window pool and its index lists (the ring
of earlier tokens then this chunk's rows), the compressed pool and its lists (CSA: the indexer's picks as rows;
HCA: every complete entry), the valid lengths and the sinks. So the study sees the very lists the kernels gather,
not a dense re-derivation. Quantized caches (`init_cache(..., kv_dtype="fp8")`) trace the stored rows; `probs`
dequantizes them like the reference op.

Probabilities come from `pallas_kernels.sparse_attention.reference.attention_probs`: the op's softmax over both
lists plus the per-head sink, split by source. They materialise every gathered row in f32, which is meant for
study-sized inputs (the embedded model, a few thousand tokens of a real one), not for long contexts.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.indexer.reference import indexer_scores as _indexer_scores
from pallas_kernels.sparse_attention import sparse_attention
from pallas_kernels.sparse_attention.reference import attention_probs

from .cache import ModelCache
from .config import CSA, SLIDING
from .layers.attention import window_key_positions
from .model import DeepseekV4ForCausalLM, forward_chunk

__all__ = ["AttentionTrace", "trace_attention"]


@dataclasses.dataclass(frozen=True)
class AttentionTrace:
    """One attention layer's inputs for one chunk (shapes: B sequences, S queries, H heads, D head_dim).

    layer, kind ("sliding" | "csa" | "hca"), ratio (compress ratio; 0 for sliding), window (W), scale, and the op's
    arguments: q [B, S, H, D], positions [B, S], window_pool [B * (W + S), D] (array or Fp8KVPool), window_idx
    [B, S, W] rows of it, compressed_pool [B * cap, D] | None, compressed_idx [B, S, Kc] | None, compressed_len
    [B, S] | None, sinks [H]. CSA only: indexer_q [B, S, Hi, Di], indexer_w [B, S, Hi], indexer_keys [B, cap, Di]
    (array or quantized), indexer_n_visible [B, S], picks [B, S, k] (entry indices, -1 none)."""

    layer: int
    kind: str
    ratio: int
    window: int
    scale: float
    q: jax.Array
    positions: jax.Array
    window_pool: object
    window_idx: jax.Array
    compressed_pool: object = None
    compressed_idx: jax.Array | None = None
    compressed_len: jax.Array | None = None
    sinks: jax.Array | None = None
    indexer_q: jax.Array | None = None
    indexer_w: jax.Array | None = None
    indexer_keys: object = None
    indexer_n_visible: jax.Array | None = None
    picks: jax.Array | None = None

    @property
    def capacity(self) -> int:
        """Compressed entries per sequence in the cache (0 for sliding layers)."""
        if self.compressed_idx is None:
            return 0
        rows = jax.tree_util.tree_leaves(self.compressed_pool)[0].shape[0]
        return rows // self.q.shape[0]

    def probs(self):
        """(p_window [B, S, H, W], p_compressed [B, S, H, Kc] or None, p_sink [B, S, H]) float32: the op's softmax
        split by source; per query and head the three sum to 1; invalid list slots get 0."""
        return attention_probs(self.q, self.window_pool, self.window_idx, self.compressed_pool, self.compressed_idx,
                               self.sinks, scale=self.scale, compressed_len=self.compressed_len)

    def output(self, impl: str = "reference", **kernel_options):
        """The sparse-attention op on these inputs, [B, S, H, D] (before the layer's inverse RoPE): impl "reference"
        or "pallas" (a kernel; on a CPU the Pallas interpreter), so a kernel can be checked on a real layer's lists."""
        return _output(self.q, self.window_pool, self.window_idx, self.compressed_pool, self.compressed_idx,
                       self.sinks, self.compressed_len, scale=self.scale, impl=impl,
                       options=tuple(sorted(kernel_options.items())))

    def window_positions(self) -> jax.Array:
        """[B, S, W] int32: the token position each window slot holds, oldest first (the last is the query itself);
        -1 before the sequence start."""
        return _window_positions(self.window_idx, self.positions, window=self.window)

    def compressed_entries(self) -> jax.Array | None:
        """[B, S, Kc] int32: the compressed entry index each list slot names (CSA: the indexer's picks; HCA: every
        complete entry, in order), -1 where the slot is empty or past the list's valid length; None for sliding."""
        if self.compressed_idx is None:
            return None
        return _compressed_entries(self.compressed_idx, self.compressed_len, capacity=self.capacity)

    def entry_span(self, entry: int) -> tuple[int, int]:
        """Token positions (first, last) whose kv entry `entry` pools: ratio tokens, and for CSA's overlapping
        compressor also the ratio tokens before them (its RoPE sits at the first of its own ratio tokens)."""
        if self.kind == SLIDING:
            raise ValueError(f"layer {self.layer} is a sliding-window layer: it has no compressed entries")
        first = entry * self.ratio - (self.ratio if self.kind == CSA else 0)
        return max(first, 0), (entry + 1) * self.ratio - 1

    def indexer_scores(self) -> jax.Array:
        """CSA only: the indexer's scores [B, S, capacity] float32 (reference arithmetic on the traced q, weights and
        keys; -inf where the entry is not causally complete for the query). The picks are their top k."""
        if self.kind != CSA:
            raise ValueError(f"layer {self.layer} is a {self.kind} layer: only CSA layers have an indexer")
        return _indexer_scores(self.indexer_q, self.indexer_w, self.indexer_keys, self.indexer_n_visible)


# The trace's views, each one jitted program per shape: run op by op, every jnp call would compile on its own
# (dozens of small XLA:CPU compiles per call, seconds in a notebook). attention_probs and the indexer's reference
# scores are jitted where they are defined.
@functools.partial(jax.jit, static_argnames=("scale", "impl", "options"), inline=True)
def _output(q, window_pool, window_idx, compressed_pool, compressed_idx, sinks, compressed_len, *, scale, impl,
            options):
    return sparse_attention(q, window_pool, window_idx, compressed_pool, compressed_idx, sinks, scale=scale,
                            compressed_len=compressed_len, impl=impl, **dict(options))


@functools.partial(jax.jit, static_argnames=("window",), inline=True)
def _window_positions(window_idx, positions, *, window):
    return jnp.where(window_idx >= 0, window_key_positions(positions, window), -1)


@functools.partial(jax.jit, static_argnames=("capacity",), inline=True)
def _compressed_entries(compressed_idx, compressed_len, *, capacity):
    B, _, K = compressed_idx.shape
    row0 = jnp.arange(B, dtype=jnp.int32)[:, None, None] * capacity
    slot = jnp.arange(K, dtype=jnp.int32)[None, None, :]
    valid = (compressed_idx >= 0) & (slot < compressed_len[..., None])
    return jnp.where(valid, compressed_idx - row0, -1)


def trace_attention(model: DeepseekV4ForCausalLM, input_ids, cache: ModelCache | None = None, lengths=None):
    """Runs one right-padded chunk [B, S] like `model.prefill` (after what `cache` holds; a fresh cache of
    capacity S when None) and returns (logits [B, S, vocab], [AttentionTrace per layer], new cache).
    The same checks as prefill: ids in the vocabulary, lengths in [0, S], the cache's batch and capacity."""
    if cache is None:
        B, S = model._check_ids(input_ids).shape
        cache = model.init_cache(B, S)
    ids, lengths = model._check_chunk(input_ids, cache, lengths)
    graphdef, state = nnx.split(model)
    logits, new_cache, records = _traced_chunk(graphdef, state, cache, ids, lengths)
    c = model.config
    traces = []
    for i, rec in enumerate(records):
        kind = c.layer_types[i]
        traces.append(AttentionTrace(layer=i, kind=kind, ratio=c.compress_ratios[i] if kind != SLIDING else 0,
                                     window=c.sliding_window, scale=c.head_dim ** -0.5, **rec))
    return logits, traces, new_cache


@jax.jit(static_argnums=0)
def _traced_chunk(graphdef, state, cache, input_ids, lengths):
    records = []
    logits, cache = forward_chunk(nnx.merge(graphdef, state), input_ids, cache, lengths, trace=records)
    return logits, cache, records
