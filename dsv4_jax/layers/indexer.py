"""Lightning Indexer (spec §3.8): picks the top-k compressed entries each query of a CSA layer attends to.

score[t, w] = sum_h ReLU(q_I[t, h] . k_I[w]) * index_head_dim^-0.5 * weights_proj(x_t)[h] * index_n_heads^-0.5
over causally complete entries w < floor((t + 1) / ratio); top-k (k = min(index_topk, capacity)); picks that are
not causally visible come back as -1. Ties go to the lower entry index (lax.top_k order). The indexer has its own
overlapping compressor (width index_head_dim) that fills `indexer_keys` exactly like the main one fills
`compressed_kv`; q_I comes from the q-LoRA residual `qr` with RoPE at the token position.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_kernels.indexer import formats

from ..config import DeepseekV4Config
from .common import Linear, matmul
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

    def encode_keys(self, fmt, rotate: bool, dtype):
        """float32 pooled keys [..., dI] -> storage in `fmt` (rotated first when `rotate`)."""
        return lambda k: formats.quantize(formats.hadamard(k) if rotate else k, fmt, dtype)

    def scores(self, x: jax.Array, qr: jax.Array, positions: jax.Array, keys, fmt=None, rotate=False) -> jax.Array:
        """x [B, S, D], qr [B, S, q_lora], positions [B, S], keys [B, T, dI] (array or quantized storage in `fmt`)
        -> scores [B, S, T] float32, -inf where the entry is not causally complete for the query. Queries get the
        keys' rotation and (fake) quantization."""
        B, S = x.shape[:2]
        q = matmul(qr, self.wq_b.weight[...], jnp.float32).reshape(B, S, self.n_heads, self.head_dim)
        q = apply_rope(q, positions, self.inv_freq)
        if rotate:
            q = formats.hadamard(q)
        if fmt in ("fp8", "fp4"):
            q = formats.fake_quantize(q, fmt)
        keys = formats.dequantize(keys, jnp.float32)
        logits = jnp.einsum("bshd,btd->bsht", q, keys, precision=jax.lax.Precision.HIGHEST)
        w = matmul(x, self.weights_proj.weight[...], jnp.float32) * self.n_heads ** -0.5       # [B, S, H]
        s = jnp.einsum("bsht,bsh->bst", jax.nn.relu(logits) * self.head_dim ** -0.5, w,
                       precision=jax.lax.Precision.HIGHEST)
        visible = jnp.arange(keys.shape[1])[None, None, :] < ((positions + 1) // self.ratio)[..., None]
        return jnp.where(visible, s, -jnp.inf)

    def select(self, scores: jax.Array) -> jax.Array:
        """scores [B, S, T] -> entry indices [B, S, min(topk, T)] int32, -1 where not visible."""
        k = min(self.topk, scores.shape[-1])
        vals, idx = jax.lax.top_k(scores, k)
        return jnp.where(jnp.isfinite(vals), idx, -1).astype(jnp.int32)
