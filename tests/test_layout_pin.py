"""TPU-layout helpers of the layers: the row-major pin of the attention q / o chain (`pin_row_major`)
and the per-head q projection (matmul_heads)."""

import jax
import jax.numpy as jnp
import numpy as np
from dsv4_jax.layers.common import pin_row_major


def test_pin_row_major_keeps_values():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 3, 4, 8)), jnp.float32)
    assert pin_row_major(x, False) is x
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda a: pin_row_major(a, True) * 2)(x)), np.asarray(x) * 2)


def test_matmul_heads_equals_the_flat_projection():
    """`matmul_heads` (the TPU path's per-head q projection) gives the flat projection's values, reshaped, bit for
    bit: the same products and f32 sums, in the output dtype asked for."""
    from dsv4_jax.layers.common import matmul, matmul_heads

    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((2, 5, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((8 * 16, 64)), jnp.bfloat16)
    for out_dtype in (None, jnp.float32):
        flat = jax.jit(lambda x, w: matmul(x, w, out_dtype).reshape(2, 5, 8, 16))(x, w)
        heads = jax.jit(lambda x, w: matmul_heads(x, w, 8, out_dtype))(x, w)
        assert heads.dtype == flat.dtype and heads.shape == (2, 5, 8, 16)
        np.testing.assert_array_equal(np.asarray(heads, np.float32), np.asarray(flat, np.float32))
