"""Indexer key formats (bf16 / fp8 132 B / fp4 68 B) and the Walsh-Hadamard rotation, against hand-computed values."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv4_jax.config import tiny
from dsv4_jax.model import DeepseekV4ForCausalLM
from pallas_kernels.indexer import formats as F
from tiers import full_tier


def test_fp8_key_hand_computed():
    x = np.zeros((1, 32), np.float32)
    x[0, :4] = [1.0, -0.5, 3.0, 1.1]
    q = F.quantize(jnp.asarray(x), "fp8")
    # amax 3 -> s = 2^ceil(log2(3/448)) = 2^-7; 1.1 * 128 = 140.8 -> e4m3 step 16 in [128, 256) -> 144
    assert float(q.scale[0, 0]) == 2.0 ** -7
    np.testing.assert_array_equal(np.asarray(q.values.astype(jnp.float32))[0, :4], [128, -64, 384, 144])
    np.testing.assert_array_equal(np.asarray(F.dequantize(q))[0, :4], [1.0, -0.5, 3.0, 144 / 128])
    assert q.values.dtype == jnp.float8_e4m3fn and q.scale.dtype == jnp.float32


def test_fp4_key_hand_computed():
    x = np.zeros((1, 64), np.float32)
    x[0, :4] = [6.0, 1.0, -0.5, 2.5]      # block 0: amax 6 -> scale 2^0 (byte 127)
    x[0, 32:34] = [0.75, -0.1]            # block 1: amax 0.75 -> s = 2^ceil(log2(0.125)) = 2^-3 (byte 124)
    q = F.quantize(jnp.asarray(x), "fp4")
    np.testing.assert_array_equal(np.asarray(q.scale)[0], [127, 124])
    # codes: 6 -> 7, 1 -> 2, -0.5 -> 8|1 = 9, 2.5 -> tie 2|3 -> even code 4 (=2.0); low nibble = even element
    np.testing.assert_array_equal(np.asarray(q.values)[0, :2], [7 | 2 << 4, 9 | 4 << 4])
    # block 1: 0.75 / 0.125 = 6 -> 7; -0.1 / 0.125 = -0.8 -> -1.0 -> 8|2 = 10
    assert int(np.asarray(q.values)[0, 16]) == 7 | 10 << 4
    d = np.asarray(F.dequantize(q))[0]
    np.testing.assert_array_equal(d[:4], [6.0, 1.0, -0.5, 2.0])
    np.testing.assert_array_equal(d[32:34], [0.75, -0.125])
    assert q.values.dtype == jnp.uint8 and q.values.shape == (1, 32)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp4"])
def test_round_trip_is_a_fixed_point(fmt):
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 5, 128)) * 3, jnp.float32)
    d = F.dequantize(F.quantize(x, fmt))
    np.testing.assert_array_equal(np.asarray(F.dequantize(F.quantize(d, fmt))), np.asarray(d))
    assert F.BYTES_PER_KEY[fmt](128) == {"bf16": 256, "fp8": 132, "fp4": 68}[fmt]


def test_hadamard():
    np.testing.assert_allclose(np.asarray(F.hadamard(jnp.array([1.0, 2.0, 3.0, 4.0]))), [5.0, -1.0, -2.0, 0.0])
    x = jnp.asarray(np.random.default_rng(1).standard_normal((4, 128)), jnp.float32)
    np.testing.assert_allclose(np.asarray(F.hadamard(F.hadamard(x))), np.asarray(x), atol=1e-5)  # involution
    with pytest.raises(ValueError, match="power-of-two"):
        F.hadamard(jnp.ones((3, 96)))


@full_tier
def test_rotation_without_quantization_is_a_no_op_in_the_model():
    cfg = tiny()
    model = DeepseekV4ForCausalLM(cfg, rngs=nnx.Rngs(2), attention_impl="reference")
    ids = np.random.default_rng(4).integers(0, cfg.vocab_size, (2, 30))
    base, _ = model.prefill(ids, model.init_cache(2, 32))
    rot, _ = model.prefill(ids, model.init_cache(2, 32, indexer_rotate=True))
    np.testing.assert_allclose(np.asarray(rot), np.asarray(base), rtol=0, atol=1e-4 * np.abs(np.asarray(base)).max())


def test_quantized_indexer_cache_is_stored_quantized():
    cfg = tiny()
    model = DeepseekV4ForCausalLM(cfg, rngs=nnx.Rngs(2), attention_impl="reference")
    cache = model.init_cache(1, 32, indexer_dtype="fp4", indexer_rotate=True)
    csa = cfg.layer_types.index("csa")
    keys = cache.layers[csa].indexer_keys
    assert isinstance(keys, F.QuantizedKeys) and keys.values.dtype == jnp.uint8
    assert keys.values.shape == (1, 32 // 4, cfg.index_head_dim // 2)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 20))
    _, cache = model.prefill(ids, cache)
    d = np.asarray(F.dequantize(cache.layers[csa].indexer_keys))[0, :5]
    # every stored key is exactly representable: re-quantizing changes nothing
    np.testing.assert_array_equal(np.asarray(F.dequantize(F.quantize(jnp.asarray(d), "fp4"))), d)
    with pytest.raises(ValueError, match="indexer key format"):
        model.init_cache(1, 32, indexer_dtype="int8")


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp4"])
def test_fake_quantize_rounds_inside_a_jitted_program(fmt):
    """fake_quantize fused between other ops of a jitted program equals it computed on the CPU. On a GPU this
    guards the optimization barrier in fake_quantize: XLA's GPU compiler drops an f32 -> narrower float -> f32 round
    trip (--xla_allow_excess_precision), which left the indexer's q unquantized on the H200 (session 21)."""
    import jax

    u = np.random.default_rng(11).standard_normal((4, 3, 128)).astype(np.float32)
    # x 2 and x 0.5 around it: the quantization sits inside a fusion; power-of-two scales make it exact to move
    out = np.asarray(jax.jit(lambda u: F.fake_quantize(u * 2.0, fmt) * 0.5)(jnp.asarray(u)))
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        expected = np.asarray(F.fake_quantize(jax.device_put(jnp.asarray(u), cpu), fmt))
    assert np.any(expected != u), "the test data are already representable"
    np.testing.assert_array_equal(out, expected)
