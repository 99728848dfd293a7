"""The row-major layout pin of the attention q / o chain (dsv4_jax.layers.common.pin_row_major)."""

import jax
import jax.numpy as jnp
import numpy as np
from dsv4_jax.layers.common import pin_row_major


def test_pin_row_major_keeps_values():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 3, 4, 8)), jnp.float32)
    assert pin_row_major(x, False) is x
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda a: pin_row_major(a, True) * 2)(x)), np.asarray(x) * 2)
