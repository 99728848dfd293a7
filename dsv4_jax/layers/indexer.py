"""Lightning Indexer (spec §3.8): picks the top-k compressed entries each query of a CSA layer attends to.

score[t, w] = sum_h ReLU(q_I[t, h] . k_I[w]) * index_head_dim^-0.5 * weights_proj(x_t)[h] * index_n_heads^-0.5
over causally complete entries w < floor((t + 1) / ratio); top-k (k = min(index_topk, capacity)); picks that are
not causally visible come back as -1. Ties go to the lower entry index (lax.top_k order). The indexer has its own
overlapping compressor (width index_head_dim) that fills `indexer_keys` exactly like the main one fills
`compressed_kv`; q_I comes from the q-LoRA residual `qr` with RoPE at the token position.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from pallas_kernels.indexer import formats, indexer_topk, resolve_impl

from ..config import DeepseekV4Config
from .common import Linear, matmul, matmul_heads
from .compressor import Compressor
from .rope import apply_rope


class Indexer(nnx.Module):
    def __init__(self, config: DeepseekV4Config, ratio: int, inv_freq: tuple, *, dtype, rngs: nnx.Rngs):
        self.n_heads, self.head_dim, self.topk, self.ratio = (
            config.index_n_heads, config.index_head_dim, config.index_topk, ratio)
        self.inv_freq = inv_freq
        self.wq_b = Linear(config.q_lora_rank, self.n_heads * self.head_dim, dtype=dtype, rngs=rngs,
                           axes=("heads", None))
        self.weights_proj = Linear(config.hidden_size, self.n_heads, dtype=dtype, rngs=rngs, axes=("heads", "embed"))
        self.compressor = Compressor(config.hidden_size, self.head_dim, ratio, True, config.rms_norm_eps, inv_freq,
                                     dtype=dtype, rngs=rngs)

    def select(self, x, qr, positions, keys, fmt=None, rotate=False, impl="reference", picks="sorted"):
        """x [B, S, D], qr [B, S, q_lora], positions [B, S], keys [B, T, dI] (array or quantized storage in `fmt`)
        -> picks [B, S, min(topk, T)] int32 entry indices (-1 where not causally visible), best first (picks
        "sorted") or in ascending index order (picks "set"); the -1s come last either way.
        Queries get the keys' rotation and (fake) quantization; the quantization is left to the op (`quantize_q`),
        which skips it where its kernel quantizes q itself (the Mosaic GPU kernel, the TPU kernel over fp4 keys: the
        same scores, fewer kernels)."""
        q, w = self.query(x, qr, positions, fmt, rotate, quantize=False, heads_dot=resolve_impl(impl) == "tpu")
        return indexer_topk(q, w, keys, self.n_visible(positions), k=self.topk, impl=impl, picks=picks,
                            quantize_q=fmt in ("fp8", "fp4"))

    def query(self, x, qr, positions, fmt=None, rotate=False, quantize=True, heads_dot=False):
        """The scoring side of `select`: (q [B, S, n_heads, head_dim] f32 with RoPE, the keys' rotation and (fake)
        quantization (quantize=False: not quantized); head weights [B, S, n_heads] f32 with both scale factors folded
        in). heads_dot (the TPU kernel path): q's projection written straight into [B, S, n_heads, head_dim]
        (`matmul_heads`: the same products and sums, no re-tiling of the flat result on a TPU)."""
        B, S = x.shape[:2]
        if heads_dot:
            q = matmul_heads(qr, self.wq_b.weight[...], self.n_heads, jnp.float32)
        else:
            q = matmul(qr, self.wq_b.weight[...], jnp.float32).reshape(B, S, self.n_heads, self.head_dim)
        q = apply_rope(q, positions, self.inv_freq)
        if rotate:
            q = formats.hadamard(q)
        if quantize and fmt in ("fp8", "fp4"):
            q = formats.fake_quantize(q, fmt)
        w = matmul(x, self.weights_proj.weight[...], jnp.float32) * (self.n_heads ** -0.5 * self.head_dim ** -0.5)
        return q, w

    def n_visible(self, positions):
        """[B, S] causally complete entries of each query: floor((t + 1) / ratio)."""
        return (positions + 1) // self.ratio
