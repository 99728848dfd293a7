"""KV compressor chunk update — plain-jnp reference, the contract of the fused compressor kernels (spec §3.7).

Inputs are one chunk's *projected* kv and gate (gate already + `ape[pos mod ratio]`), float32. For every row the
open-window state and the chunk tokens are laid on the row's window grid (base = start - start % ratio); every
window that closes at a valid token is pooled channel-wise with a softmax over its slots (2 * ratio slots for an
overlapping compressor: the previous window's A-half + this window's B-half), RMS-normed (weight), rotated at
position w * ratio on the trailing rope channels, encoded to the cache format and written at entry w. The window
still open after the chunk becomes the new state (and, overlapping, the window before it gives the A-half).

Shapes: kv, gate [B, S, c * d] (c = 2 if overlap); start, n_valid [B] int32; state_kv, state_gate [B, ratio, c * d];
prev_kv, prev_gate [B, ratio, d] (overlap only; else None); entries: [B, cap, d] array or a pytree of arrays with
leading [B, cap] produced by `encode` (a quantized format). Windows that would land at w >= cap are dropped (the
caller checks capacity). Row independence: row b reads only row b.
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp

from ..numerics import round_to
from ..rope import apply_rope
from .common import validate


def compress_chunk(kv, gate, start, n_valid, state_kv, state_gate, prev_kv, prev_gate, entries, *, ratio: int,
                   overlap: bool, norm_weight, eps: float, inv_freq, norm_dtype=jnp.float32,
                   encode: Optional[Callable] = None):
    """-> (entries, state_kv, state_gate, prev_kv, prev_gate), all updated."""
    validate(kv, gate, start, n_valid, state_kv, state_gate, prev_kv, prev_gate, entries, ratio=ratio,
             overlap=overlap, norm_weight=norm_weight)
    r = ratio
    win_kv, win_gate, pool_kv, pool_gate = window_pools(kv, gate, start, n_valid, state_kv, state_gate, prev_kv,
                                                        prev_gate, ratio=r, overlap=overlap)
    offset = start % r
    n_windows = win_kv.shape[1]
    pooled = jnp.sum(jax.nn.softmax(pool_gate, axis=2) * pool_kv, axis=2)      # [B, nW, d] float32
    pooled = round_to(pooled, norm_dtype)          # bit arithmetic for bf16: XLA GPU folds a two-cast round trip
    pooled = pooled * jax.lax.rsqrt(jnp.mean(pooled * pooled, axis=-1, keepdims=True) + eps) * norm_weight
    pooled = pooled.astype(norm_dtype)
    window_pos = (start - offset)[:, None] + jnp.arange(n_windows, dtype=jnp.int32)[None, :] * r
    pooled = apply_rope(pooled, window_pos, inv_freq)                           # RoPE at the window's first token
    encoded = encode(pooled) if encode is not None else pooled.astype(entries.dtype)
    entries = write_complete_windows(entries, encoded, start, n_valid, ratio=r)
    return (entries,) + open_window_state(win_kv, win_gate, prev_kv, prev_gate, start, n_valid, ratio=r,
                                          overlap=overlap)


def write_complete_windows(entries, encoded, start, n_valid, *, ratio: int):
    """entries (pytree, leading [B, cap]) with encoded (the same pytree, leading [B, nW]: one row per window of the
    grid) written at entry w = the window's first grid position / ratio, for every window that closes at a valid
    token; windows at w >= cap are dropped (the caller checks capacity)."""
    r = ratio
    n_windows = jax.tree_util.tree_leaves(encoded)[0].shape[1]
    window_pos = (start - start % r)[:, None] + jnp.arange(n_windows, dtype=jnp.int32)[None, :] * r
    complete = window_pos + r <= (start + n_valid)[:, None]
    cap = jax.tree_util.tree_leaves(entries)[0].shape[1]
    dest = jnp.where(complete, window_pos // r, cap)                           # cap = out of bounds -> dropped
    rows = jnp.broadcast_to(jnp.arange(dest.shape[0])[:, None], dest.shape)
    return jax.tree_util.tree_map(lambda buf, new: buf.at[rows, dest].set(new.astype(buf.dtype), mode="drop"),
                                  entries, encoded)


def open_window_state(win_kv, win_gate, prev_kv, prev_gate, start, n_valid, *, ratio: int, overlap: bool):
    """The new (state_kv, state_gate, prev_kv, prev_gate) from `window_pools`' grid: the window left open,
    k_open = (start % ratio + n_valid) // ratio, and for an overlapping compressor the A-half of the window before it
    (the old prev state when k_open = 0)."""
    r = ratio
    d = prev_kv.shape[-1] if overlap else None
    k_open = (start % r + n_valid) // r
    def pick(t, i):   # t[b, i[b]]; a select where the grid has two windows (decode), else a gather
        if t.shape[1] == 2:
            return jnp.where((i == 0)[:, None, None], t[:, 0], t[:, 1])
        return jnp.take_along_axis(t, i[:, None, None, None], axis=1)[:, 0]
    state_kv, state_gate = pick(win_kv, k_open), pick(win_gate, k_open)
    if overlap:
        has_prev = (k_open >= 1)[:, None, None]
        km1 = jnp.maximum(k_open - 1, 0)
        prev_kv = jnp.where(has_prev, pick(win_kv, km1)[..., :d], prev_kv)
        prev_gate = jnp.where(has_prev, pick(win_gate, km1)[..., :d], prev_gate)
    return state_kv, state_gate, prev_kv, prev_gate


def window_pools(kv, gate, start, n_valid, state_kv, state_gate, prev_kv, prev_gate, *, ratio: int, overlap: bool):
    """Each row's window grid (base = start - start % ratio; n_windows = (ratio - 1 + S) // ratio + 1, enough that
    the window left open is always inside): (win_kv, win_gate) [B, nW, ratio, c * d], grid slot g holding chunk
    token g - start % ratio where that is in [0, n_valid), else open-window state slot g if g < start % ratio, else
    0; and (pool_kv, pool_gate) [B, nW, c * ratio, d], the slots each window pools: for an overlapping compressor
    the previous window's A-half (channels [0, d); prev_kv / prev_gate for window 0) then its own B-half
    (channels [d, 2d)), else the window itself."""
    r = ratio
    B, S, cd = kv.shape
    d = cd // 2 if overlap else cd
    offset = start % r                                   # slots of the open window already in the state
    n_windows = (r - 1 + S) // r + 1
    grid = jnp.arange(n_windows * r, dtype=jnp.int32)[None, :]
    chunk_j = grid - offset[:, None]                     # chunk token index at each grid slot
    from_chunk = (chunk_j >= 0) & (chunk_j < n_valid[:, None])
    from_state = grid < offset[:, None]
    if S == 1:   # decode: the grid's slots are state slots, then the one token, so broadcasts, no gathers
        # (a gather over the [B, r, c * d] state made TPU layouts relay the state out twice a step, session 51)
        take_chunk = lambda t: t
        take_state = lambda t: jnp.concatenate([t, jnp.zeros((B, n_windows * r - r, cd), t.dtype)], axis=1)
    else:
        take_chunk = lambda t: jnp.take_along_axis(t, jnp.clip(chunk_j, 0, S - 1)[..., None], axis=1)
        take_state = lambda t: jnp.take_along_axis(t, jnp.clip(grid, 0, r - 1)[..., None], axis=1)
    fill = lambda c, s: jnp.where(from_chunk[..., None], take_chunk(c),
                                  jnp.where(from_state[..., None], take_state(s), 0.0))
    win_kv = fill(kv, state_kv).reshape(B, n_windows, r, cd)
    win_gate = fill(gate, state_gate).reshape(B, n_windows, r, cd)
    if overlap:
        pool_kv = jnp.concatenate([jnp.concatenate([prev_kv[:, None], win_kv[:, :-1, :, :d]], axis=1),
                                   win_kv[..., d:]], axis=2)                     # [B, nW, 2r, d]
        pool_gate = jnp.concatenate([jnp.concatenate([prev_gate[:, None], win_gate[:, :-1, :, :d]], axis=1),
                                     win_gate[..., d:]], axis=2)
    else:
        pool_kv, pool_gate = win_kv, win_gate
    return win_kv, win_gate, pool_kv, pool_gate
