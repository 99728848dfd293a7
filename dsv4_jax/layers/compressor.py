"""KV Compressor (spec §3.7): pools every `ratio` tokens into one entry.

Per token t: a_t = wkv(x_t), z_t = wgate(x_t) + ape[t mod ratio], in float32.
* Non-overlapping (HCA): entry w = sum_j softmax_j(z) * a over the `ratio` tokens of window w, channel-wise.
* Overlapping (CSA, c = 2 series): the first `dim` features ("A") of window w-1 and the last `dim` features ("B")
  of window w form 2 * ratio slots; for w = 0 the A slots are empty (weight 0).
Then RMSNorm, RoPE on the trailing rope dims at position w * ratio. Entry w is emitted when token
(w + 1) * ratio - 1 is processed and is visible to that same token.

The chunk update (pallas_kernels.compressor.compress_chunk) is one vectorized function for prefill from empty,
chunked prefill and decode (S = 1): state slots and chunk tokens are laid out on the window grid of each row, every
window that closes inside the chunk is pooled, and the open window becomes the new state. Shapes are static;
positions and lengths are data.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.compressor import UNSET, compress_chunk

from ..cache import CompressorState
from .common import Linear, RMSNorm, matmul, normal, param


class Compressor(nnx.Module):
    """Compressor of width `dim` (head_dim for the main one, index_head_dim for the indexer's)."""

    def __init__(self, hidden: int, dim: int, ratio: int, overlap: bool, eps: float, inv_freq: tuple, *,
                 dtype, rngs: nnx.Rngs):
        c = 2 if overlap else 1
        self.dim, self.ratio, self.overlap, self.inv_freq = dim, ratio, overlap, inv_freq
        self.wkv = Linear(hidden, c * dim, dtype=dtype, rngs=rngs, axes=(None, "embed"))
        self.wgate = Linear(hidden, c * dim, dtype=dtype, rngs=rngs, axes=(None, "embed"))
        self.ape = param(normal(rngs, (ratio, c * dim), 0.5, jnp.float32), (None, None))
        self.norm = RMSNorm(dim, eps, rngs=rngs)

    def project(self, x: jax.Array, positions: jax.Array):
        """x [B, S, D], positions [B, S] -> (kv, gate) [B, S, c*dim] float32, gate including `ape`."""
        kv = matmul(x, self.wkv.weight[...], jnp.float32)
        gate = matmul(x, self.wgate.weight[...], jnp.float32)
        gate = gate + jnp.take(self.ape[...], positions % self.ratio, axis=0)
        return kv, gate

    def __call__(self, x, positions, start, n_valid, state: CompressorState, entries, *, encode=None,
                 key_format=UNSET, rotate: bool = False, impl: str = "reference"):
        """Feeds one chunk of each row to the compressor.

        Args:
          x: [B, S, D] block input of the chunk (row b's token j is at position start[b] + j).
          positions: [B, S] int32 = start[:, None] + arange(S).
          start: [B] int32 tokens already consumed per row; n_valid: [B] int32 valid chunk tokens per row.
          state: open-window state; entries: [B, cap, dim] compressed cache (entry w at row w): an array, or any
            pytree of arrays with leading [B, cap] (a quantized format).
          key_format / rotate: the storage format of `entries` by name (None: cast to the cache dtype; "bf16" |
            "fp8" | "fp4" indexer formats), which every impl supports; or `encode`, a callable float rows ->
            storage rows, which only the reference runs (used for the 584-B FP8 KV rows).
          impl: "reference" | "pallas" | "auto" (see pallas_kernels.compressor).
        Returns:
          (entries, state) updated: every window closing at a valid token is written at its index.
        """
        kv, gate = self.project(x, positions)
        entries, skv, sgate, pkv, pgate = compress_chunk(
            kv, gate, start, n_valid, state.kv, state.gate, state.prev_kv, state.prev_gate, entries,
            ratio=self.ratio, overlap=self.overlap, norm_weight=self.norm.weight[...], eps=self.norm.eps,
            inv_freq=self.inv_freq, norm_dtype=x.dtype, encode=encode, key_format=key_format, rotate=rotate,
            impl=impl)
        return entries, state.replace(kv=skv, gate=sgate, prev_kv=pkv, prev_gate=pgate)
