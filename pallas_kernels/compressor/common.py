"""Argument checks shared by every implementation of `compress_chunk` (the reference and the kernels).

    validate(kv, gate, start, n_valid, state_kv, state_gate, prev_kv, prev_gate, entries, *, ratio, overlap,
             norm_weight)

Shapes are static: the checks run at trace time. Without them a [1] `start` broadcast over the batch in the
reference, and an `entries` or state batch that is not kv's ran the kernels on the wrong rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def _shape(x):
    return tuple(x.shape) if hasattr(x, "shape") else None


def _check(name, x, shape, kind):
    if _shape(x) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {_shape(x)}")
    if not jnp.issubdtype(x.dtype, kind):
        raise ValueError(f"{name} must be {'floating point' if kind is jnp.floating else 'an integer array'}, "
                         f"got {x.dtype}")


def validate(kv, gate, start, n_valid, state_kv, state_gate, prev_kv, prev_gate, entries, *, ratio, overlap,
             norm_weight) -> None:
    """kv, gate [B, S, c * d] float (c = 2 if overlap); start, n_valid [B] integer; state_kv, state_gate
    [B, ratio, c * d] float; prev_kv, prev_gate [B, ratio, d] float (overlap) or None; entries: every array leaf
    with leading [B, cap]; norm_weight [d]; ratio an integer >= 1. ValueError naming the argument otherwise."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, np.integer)) or ratio < 1:
        raise ValueError(f"ratio must be an integer >= 1, got {ratio!r}")
    ks = _shape(kv)
    if ks is None or len(ks) != 3:
        raise ValueError(f"kv must be [batch, chunk, c * dim], got shape {ks}")
    B, S, cd = ks
    c = 2 if overlap else 1
    if cd % c:
        raise ValueError(f"an overlapping compressor's kv holds two series: its last dim must be even, got {cd}")
    d = cd // c
    _check("kv", kv, ks, jnp.floating)
    _check("gate", gate, ks, jnp.floating)
    _check("start", start, (B,), jnp.integer)
    _check("n_valid", n_valid, (B,), jnp.integer)
    _check("state_kv", state_kv, (B, ratio, cd), jnp.floating)
    _check("state_gate", state_gate, (B, ratio, cd), jnp.floating)
    if overlap:
        if prev_kv is None or prev_gate is None:
            raise ValueError("an overlapping compressor needs prev_kv and prev_gate ([batch, ratio, dim])")
        _check("prev_kv", prev_kv, (B, ratio, d), jnp.floating)
        _check("prev_gate", prev_gate, (B, ratio, d), jnp.floating)
    if _shape(norm_weight) != (d,):
        raise ValueError(f"norm_weight must have shape ({d},), got {_shape(norm_weight)}")
    leaves = jax.tree_util.tree_leaves(entries)
    if not leaves:
        raise ValueError("entries must be an array or a pytree of arrays (the compressed cache)")
    cap = None
    for leaf in leaves:
        ls = _shape(leaf)
        if ls is None or len(ls) < 2 or ls[0] != B or (cap is not None and ls[1] != cap):
            raise ValueError(f"every array of entries must have leading [batch={B}, capacity]"
                             f"{'' if cap is None else f' = [{B}, {cap}]'}, got {ls}")
        cap = ls[1]
