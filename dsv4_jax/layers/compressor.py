"""KV Compressor (spec §3.7): pools every `ratio` tokens into one entry.

Per token t: a_t = wkv(x_t), z_t = wgate(x_t) + ape[t mod ratio], in float32.
* Non-overlapping (HCA): entry w = sum_j softmax_j(z) * a over the `ratio` tokens of window w, channel-wise.
* Overlapping (CSA, c = 2 series): the first `dim` features ("A") of window w-1 and the last `dim` features ("B")
  of window w form 2 * ratio slots; for w = 0 the A slots are empty (weight 0).
Then RMSNorm, RoPE on the trailing rope dims at position w * ratio. Entry w is emitted when token
(w + 1) * ratio - 1 is processed and is visible to that same token.

The chunk update below is one vectorized function for prefill from empty, chunked prefill and decode (S = 1):
state slots and chunk tokens are laid out on the window grid of each row, every window that closes inside the
chunk is pooled, and the open window becomes the new state. Shapes are static; positions and lengths are data.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..cache import CompressorState
from .common import Linear, RMSNorm, matmul, normal, param
from .rope import apply_rope


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

    def __call__(self, x, positions, start, n_valid, state: CompressorState, entries, encode=None):
        """Feeds one chunk of each row to the compressor.

        Args:
          x: [B, S, D] block input of the chunk (row b's token j is at position start[b] + j).
          positions: [B, S] int32 = start[:, None] + arange(S).
          start: [B] int32 tokens already consumed per row; n_valid: [B] int32 valid chunk tokens per row.
          state: open-window state; entries: [B, cap, dim] compressed cache (entry w at row w): an array, or any
            pytree of arrays with leading [B, cap] (a quantized format) that `encode` produces from float rows.
          encode: float32 rows [B, n, dim] -> storage rows (default: cast to the cache dtype).
        Returns:
          (entries, state) updated: every window closing at a valid token is written at its index.
        """
        r, d = self.ratio, self.dim
        B, S = x.shape[:2]
        kv, gate = self.project(x, positions)
        # Lay state slots + chunk tokens on each row's window grid starting at base = start - start % r.
        offset = start % r                                   # slots of the open window already in `state`
        n_windows = (r - 1 + S) // r + 1                     # enough windows that the open one is always inside
        grid = jnp.arange(n_windows * r, dtype=jnp.int32)[None, :]
        chunk_j = grid - offset[:, None]                     # chunk token index at each grid slot
        from_chunk = (chunk_j >= 0) & (chunk_j < n_valid[:, None])
        from_state = grid < offset[:, None]
        take_chunk = lambda t: jnp.take_along_axis(t, jnp.clip(chunk_j, 0, S - 1)[..., None], axis=1)
        take_state = lambda t: jnp.take_along_axis(t, jnp.clip(grid, 0, r - 1)[..., None], axis=1)
        fill = lambda c, s: jnp.where(from_chunk[..., None], take_chunk(c),
                                      jnp.where(from_state[..., None], take_state(s), 0.0))
        win_kv = fill(kv, state.kv).reshape(B, n_windows, r, -1)
        win_gate = fill(gate, state.gate).reshape(B, n_windows, r, -1)
        if self.overlap:
            prev_kv = jnp.concatenate([state.prev_kv[:, None], win_kv[:, :-1, :, :d]], axis=1)
            prev_gate = jnp.concatenate([state.prev_gate[:, None], win_gate[:, :-1, :, :d]], axis=1)
            pool_kv = jnp.concatenate([prev_kv, win_kv[..., d:]], axis=2)       # [B, nW, 2r, d]
            pool_gate = jnp.concatenate([prev_gate, win_gate[..., d:]], axis=2)
        else:
            pool_kv, pool_gate = win_kv, win_gate
        pooled = jnp.sum(jax.nn.softmax(pool_gate, axis=2) * pool_kv, axis=2)   # [B, nW, d] float32
        pooled = self.norm(pooled.astype(x.dtype))
        k = jnp.arange(n_windows, dtype=jnp.int32)[None, :]
        base = start - offset
        window_pos = base[:, None] + k * r                                     # RoPE position of each entry
        pooled = apply_rope(pooled, window_pos, self.inv_freq)
        complete = window_pos + r <= (start + n_valid)[:, None]
        cap = jax.tree_util.tree_leaves(entries)[0].shape[1]
        dest = jnp.where(complete, window_pos // r, cap)                       # cap = out of bounds -> dropped
        rows = jnp.broadcast_to(jnp.arange(B)[:, None], dest.shape)
        encoded = encode(pooled) if encode is not None else pooled.astype(entries.dtype)
        entries = jax.tree_util.tree_map(lambda buf, new: buf.at[rows, dest].set(new.astype(buf.dtype), mode="drop"),
                                         entries, encoded)
        # The open window after the chunk becomes the state; for overlap the window before it gives the A-half.
        k_open = (offset + n_valid) // r
        pick = lambda t, i: jnp.take_along_axis(t, i[:, None, None, None], axis=1)[:, 0]
        new_state = state.replace(kv=pick(win_kv, k_open), gate=pick(win_gate, k_open))
        if self.overlap:
            has_prev = (k_open >= 1)[:, None, None]
            km1 = jnp.maximum(k_open - 1, 0)
            new_state = new_state.replace(
                prev_kv=jnp.where(has_prev, pick(win_kv, km1)[..., :d], state.prev_kv),
                prev_gate=jnp.where(has_prev, pick(win_gate, km1)[..., :d], state.prev_gate))
        return entries, new_state
