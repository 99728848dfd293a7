"""Query-axis chunking for the jnp references, so their memory stays O(chunk) instead of O(queries)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def map_query_chunks(fn, arrays: tuple, query_chunk: int):
    """Applies fn(arrays of <= query_chunk queries) over axis 1 (the query axis) of every array in `arrays` in
    chunks with lax.map and concatenates the results (any pytree of [B, chunk, ...] arrays) back to [B, S, ...].
    `None` entries pass through unchanged."""
    S = next(a for a in arrays if a is not None).shape[1]
    if S <= query_chunk:
        return fn(arrays)
    n_chunks = -(-S // query_chunk)
    pad = n_chunks * query_chunk - S

    def split(a):
        if a is None:
            return None
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        return jnp.moveaxis(a.reshape((a.shape[0], n_chunks, query_chunk) + a.shape[2:]), 1, 0)

    out = jax.lax.map(fn, tuple(split(a) for a in arrays))                  # leaves [n_chunks, B, chunk, ...]
    merge = lambda o: jnp.moveaxis(o, 0, 1).reshape((o.shape[1], n_chunks * query_chunk) + o.shape[3:])[:, :S]
    return jax.tree_util.tree_map(merge, out)
