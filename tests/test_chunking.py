"""pallas_kernels.chunking.map_query_chunks: the query-axis chunking of the references and the kernel paths."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.chunking import map_query_chunks


def _fn(args):
    q, none, n = args
    assert none is None and q.shape[1] == n.shape[1]
    return {"sum": (q * n[..., None, None]).sum(-1), "max": (jnp.max(q, axis=(2, 3)) + n).astype(jnp.int32)}


@pytest.mark.parametrize("S,chunk", [(19, 8), (16, 8), (5, 8), (9, 1)])
def test_map_query_chunks_equals_one_call(S, chunk):
    """Chunks of a [B, S, ...] query axis (the last one padded), a None entry passed through, a pytree of results
    with trailing dims: the same as one call over all queries, eagerly and under jit."""
    rng = np.random.default_rng(S * 100 + chunk)
    q = jnp.asarray(rng.standard_normal((3, S, 4, 6)), jnp.float32)
    n = jnp.asarray(rng.integers(0, 50, (3, S)), jnp.int32)
    want = _fn((q, None, n))
    eager = map_query_chunks(_fn, (q, None, n), chunk)
    jitted = jax.jit(lambda q, n: map_query_chunks(_fn, (q, None, n), chunk))(q, n)
    for got in (eager, jitted):
        assert got["sum"].shape == (3, S, 4) and got["max"].dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(got["sum"]), np.asarray(want["sum"]))
        np.testing.assert_array_equal(np.asarray(got["max"]), np.asarray(want["max"]))
