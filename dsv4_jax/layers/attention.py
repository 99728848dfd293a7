"""DeepSeek-V4 attention layer: shared-KV MQA over a sliding window plus compressed entries (spec §3.4-3.11).

One code path for every chunk (stateless forward, chunked prefill, decode), following design.md:
1. q = RoPE(rmsnorm_per_head(wq_b(q_norm(wq_a(x))))) and kv = RoPE(kv_norm(wkv(x))) at each token's position.
2. Window source = [ring (W rows) | chunk kv (S rows)] per row; query at position t sees positions
   max(0, t-W+1) .. t, those before the chunk from ring slot (pos mod W), the rest from the chunk. The ring is read
   before it is written.
3. CSA/HCA: the compressor consumes the chunk and writes every closed window's entry into `compressed_kv` (so an
   entry is visible to the token that closed it). CSA: the indexer's compressor fills `indexer_keys` and top-k
   picks the entries; HCA: all entries w < floor((t+1)/ratio).
4. The sparse attention op (pallas_kernels.sparse_attention) gathers both sources by flat row index and
   softmaxes with the per-head sink; inverse RoPE on the output; grouped low-rank output projection.
5. The chunk's last min(n, W) kv rows go into the ring.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.dispatch import resolve_impl
from pallas_kernels.sparse_attention import sparse_attention

from ..cache import CacheFormat, LayerCache, encode_kv, flatten_rows
from ..config import CSA, SLIDING, DeepseekV4Config
from .common import Linear, RMSNorm, normal, param, pin_row_major, rms_normalize
from .compressor import Compressor
from .indexer import Indexer
from .rope import apply_rope, rope_inv_freq


def window_key_positions(positions, W: int):
    """[B, S, W] token positions of each query's window, oldest first (the last is the query itself); negative
    before the sequence start."""
    return positions[..., None] - (W - 1) + jnp.arange(W, dtype=jnp.int32)


def window_indices(positions, start, S: int, W: int):
    """Window index list [B, S, W] into the flat pool [B * (W + S), d] built as [ring | chunk] per row; -1 = none."""
    B = positions.shape[0]
    key_pos = window_key_positions(positions, W)
    in_ring = key_pos < start[:, None, None]
    slot = jnp.where(in_ring, key_pos % W, W + key_pos - start[:, None, None])
    rows = jnp.arange(B, dtype=jnp.int32)[:, None, None] * (W + S) + slot
    return jnp.where(key_pos >= 0, rows, -1)


def write_ring(ring, kv, start, n_valid):
    """ring [B, W, d], chunk kv [B, S, d] -> ring holding the last W positions < start + n_valid (slot = pos mod W)."""
    B, W = ring.shape[:2]
    S = kv.shape[1]
    end = (start + n_valid)[:, None]
    slot = jnp.arange(W, dtype=jnp.int32)[None, :]
    newest = end - 1 - jnp.mod(end - 1 - slot, W)          # latest position that maps to this slot
    from_chunk = newest >= start[:, None]
    src = jnp.clip(newest - start[:, None], 0, S - 1)
    chunk_rows = jnp.take_along_axis(kv, src[..., None], axis=1)
    return jnp.where(from_chunk[..., None], chunk_rows.astype(ring.dtype), ring)


class Attention(nnx.Module):
    def __init__(self, config: DeepseekV4Config, layer_idx: int, *, dtype, attention_impl: str, rngs: nnx.Rngs,
                 indexer_picks: str = "sorted", attention_kernel: str = "auto"):
        c = config
        self.kind = c.layer_types[layer_idx]
        self.indexer_picks = indexer_picks  # "sorted" | "set": the order of the indexer's picks (see Indexer.select)
        self.attention_kernel = attention_kernel  # GPU sparse-attention kernel: "auto" | "mosaic" | "triton"
        self.ratio = c.compress_ratios[layer_idx]
        self.n_heads, self.head_dim, self.window = c.num_attention_heads, c.head_dim, c.sliding_window
        self.o_groups, self.o_lora_rank, self.eps = c.o_groups, c.o_lora_rank, c.rms_norm_eps
        self.attention_impl = attention_impl
        self.inv_freq = rope_inv_freq(c, compressed=self.kind != SLIDING)
        self.wq_a = Linear(c.hidden_size, c.q_lora_rank, dtype=dtype, rngs=rngs, axes=(None, "embed"))
        self.q_norm = RMSNorm(c.q_lora_rank, c.rms_norm_eps, rngs=rngs)
        self.wq_b = Linear(c.q_lora_rank, self.n_heads * self.head_dim, dtype=dtype, rngs=rngs, axes=("heads", None))
        self.wkv = Linear(c.hidden_size, self.head_dim, dtype=dtype, rngs=rngs, axes=(None, "embed"))
        self.kv_norm = RMSNorm(self.head_dim, c.rms_norm_eps, rngs=rngs)
        group_in = self.n_heads * self.head_dim // self.o_groups
        self.wo_a = Linear(group_in, self.o_groups * self.o_lora_rank, dtype=dtype, rngs=rngs, axes=("heads", None))
        self.wo_b = Linear(self.o_groups * self.o_lora_rank, c.hidden_size, dtype=dtype, rngs=rngs,
                           axes=("embed", "heads"))
        self.attn_sink = param(normal(rngs, (self.n_heads,), 1.0, jnp.float32), ("heads",))
        if self.kind != SLIDING:
            self.compressor = Compressor(c.hidden_size, self.head_dim, self.ratio, self.kind == CSA, c.rms_norm_eps,
                                         self.inv_freq, dtype=dtype, rngs=rngs)
        if self.kind == CSA:
            self.indexer = Indexer(c, self.ratio, self.inv_freq, dtype=dtype, rngs=rngs)

    def __call__(self, x, positions, start, n_valid, cache: LayerCache, fmt: CacheFormat = CacheFormat(),
                 trace: list | None = None):
        """x [B, S, D] (attn_norm output), positions [B, S], start/n_valid [B] -> (out [B, S, D], cache).
        `fmt` says how cache rows are stored; quantized rows are what every query sees, the chunk's own too.
        trace: a list that receives one dict of this call's attention inputs (the op's arguments, and for CSA the
        indexer's q, weights, keys, visible counts and picks): `dsv4_jax.inspect_attention` builds on it."""
        B, S, _ = x.shape
        H, d, W = self.n_heads, self.head_dim, self.window
        # on a TPU the kernel takes q / o row-major: pin the chain to it (see pin_row_major)
        on_tpu = resolve_impl(self.attention_impl, "sparse_attention") == "tpu"
        qr = self.q_norm(self.wq_a(x))                                            # [B, S, q_lora]
        q = pin_row_major(self.wq_b(qr).reshape(B, S, H, d), on_tpu)
        q = (rms_normalize(q, self.eps)).astype(x.dtype)                          # weightless per-head norm
        q = pin_row_major(apply_rope(q, positions, self.inv_freq), on_tpu)
        kv = apply_rope(self.kv_norm(self.wkv(x)), positions, self.inv_freq)     # [B, S, d]

        kv = encode_kv(kv, fmt.kv, x.dtype)           # quantized formats: every query sees the stored values
        window_pool = jax.tree_util.tree_map(lambda ring, new: jnp.concatenate([ring, new.astype(ring.dtype)], 1),
                                             cache.window_kv, kv)
        window_idx = window_indices(positions, start, S, W)
        compressed_pool = compressed_idx = compressed_len = None
        if self.kind != SLIDING:
            entries, comp_state = self.compressor(x, positions, start, n_valid, cache.compressor, cache.compressed_kv,
                                                  key_format=fmt.compressed_key_format,
                                                  impl=self.attention_impl)
            cache = cache.replace(compressed_kv=entries, compressor=comp_state)
            cap = jax.tree_util.tree_leaves(entries)[0].shape[1]
            row0 = jnp.arange(B, dtype=jnp.int32)[:, None, None] * cap
            if self.kind == CSA:
                keys, idx_state = self.indexer.compressor(
                    x, positions, start, n_valid, cache.indexer, cache.indexer_keys, key_format=fmt.indexer,
                    rotate=fmt.indexer_rotate, impl=self.attention_impl)
                cache = cache.replace(indexer_keys=keys, indexer=idx_state)
                picks = self.indexer.select(x, qr, positions, keys, fmt.indexer, fmt.indexer_rotate,
                                            impl=self.attention_impl, picks=self.indexer_picks)
                compressed_idx = jnp.where(picks >= 0, row0 + picks, -1)
                compressed_len = jnp.sum(picks >= 0, axis=-1, dtype=jnp.int32)  # valid picks come first
            else:
                w = jnp.arange(cap, dtype=jnp.int32)[None, None, :]
                n_complete = jnp.minimum((positions + 1) // self.ratio, cap)
                compressed_idx = jnp.where(w < n_complete[..., None], row0 + w, -1)
                compressed_len = n_complete  # kernels stop after the complete entries
            compressed_pool = flatten_rows(entries)

        window_pool = flatten_rows(window_pool)                                   # [B * (W + S), d]
        if trace is not None:
            record = dict(q=q, positions=positions, window_pool=window_pool, window_idx=window_idx,
                          compressed_pool=compressed_pool, compressed_idx=compressed_idx,
                          compressed_len=compressed_len, sinks=self.attn_sink[...])
            if self.kind == CSA:
                iq, iw = self.indexer.query(x, qr, positions, fmt.indexer, fmt.indexer_rotate)
                record.update(indexer_q=iq, indexer_w=iw, indexer_keys=cache.indexer_keys,
                              indexer_n_visible=self.indexer.n_visible(positions), picks=picks)
            trace.append(record)
        o = sparse_attention(q, window_pool, window_idx, compressed_pool, compressed_idx,
                             self.attn_sink[...], scale=d ** -0.5, compressed_len=compressed_len,
                             impl=self.attention_impl, kernel=self.attention_kernel)
        o = apply_rope(pin_row_major(o, on_tpu), positions, self.inv_freq, inverse=True)  # [B, S, H, d]
        grouped = o.reshape(B, S, self.o_groups, H * d // self.o_groups)
        wo_a = self.wo_a.weight[...].reshape(self.o_groups, self.o_lora_rank, -1)
        u = jnp.einsum("bsgi,gri->bsgr", grouped.astype(wo_a.dtype), wo_a, preferred_element_type=jnp.float32)
        out = self.wo_b(u.reshape(B, S, -1).astype(x.dtype))
        cache = cache.replace(window_kv=jax.tree_util.tree_map(lambda ring, new: write_ring(ring, new, start, n_valid),
                                                               cache.window_kv, kv))
        return out, cache
