"""Exact tests of the checkpoint number formats (dsv4_jax.quant) against hand-computed vectors."""

import math

import ml_dtypes
import numpy as np
import pytest

from dsv4_jax import quant as Q


def test_e8m0_decode_hand_values():
    b = np.array([127, 128, 126, 0, 254, 255, 130], np.uint8)
    got = Q.e8m0_to_float(b)
    want = np.array([1.0, 2.0, 0.5, 2.0 ** -127, 2.0 ** 127, np.nan, 8.0], np.float32)
    np.testing.assert_array_equal(got, want)  # NaN == NaN for assert_array_equal
    assert got.dtype == np.float32
    # ml_dtypes view gives the same numbers
    np.testing.assert_array_equal(got[:5], b[:5].view(ml_dtypes.float8_e8m0fnu).astype(np.float32))


def test_e8m0_encode_roundtrip_and_rejects():
    s = np.array([1.0, 2.0, 0.25, 2.0 ** -127, 2.0 ** 127])
    np.testing.assert_array_equal(Q.float_to_e8m0(s), [127, 128, 125, 0, 254])
    np.testing.assert_array_equal(Q.e8m0_to_float(Q.float_to_e8m0(s)), s.astype(np.float32))
    with pytest.raises(ValueError):
        Q.float_to_e8m0([3.0])


def test_pow2_exponent_exact():
    # ceil(log2(amax/448)): 448 -> 0, 449 -> 1, 224 -> -1, 896 -> 1, 897 -> 2
    np.testing.assert_array_equal(Q.pow2_scale_exponent([448, 449, 224, 896, 897], 448.0, 1e-4), [0, 1, -1, 1, 2])
    np.testing.assert_array_equal(Q.pow2_scale_exponent([6, 6.5, 3, 0.75], 6.0, 1e-30), [0, 1, -1, -3])
    assert Q.pow2_scale_exponent(0.0, 448.0, 1e-4) == math.ceil(math.log2(1e-4 / 448))


def test_e4m3_hand_values():
    bits = np.array([0x00, 0x38, 0x40, 0xB8, 0x7E, 0x01, 0x08, 0x39], np.uint8)
    # 0x38 = exp 7 (bias 7) mant 0 -> 1; 0x40 -> 2; 0xB8 -> -1; 0x7E -> 448; 0x01 -> 2^-9; 0x08 -> 2^-6; 0x39 -> 1.125
    want = np.array([0, 1, 2, -1, 448, 2.0 ** -9, 2.0 ** -6, 1.125], np.float32)
    np.testing.assert_array_equal(Q.e4m3_to_float(bits), want)
    np.testing.assert_array_equal(Q.float_to_e4m3(want), bits)
    np.testing.assert_array_equal(Q.float_to_e4m3([1000.0, -1e9]), [0x7E, 0xFE])  # saturates


def test_fp8_block_dequant_hand():
    # 2 x 130 weight -> scale [1, 2]; column 128.. uses the second scale
    w = np.full((2, 130), 0x38, np.uint8)  # all ones
    scale = np.array([[126, 130]], np.uint8)  # 0.5, 8
    out = Q.dequant_fp8_block(w, scale)
    assert out.shape == (2, 130)
    np.testing.assert_array_equal(out[:, :128], 0.5)
    np.testing.assert_array_equal(out[:, 128:], 8.0)
    with pytest.raises(ValueError):
        Q.dequant_fp8_block(w, np.zeros((1, 1), np.uint8))


def test_fp8_block_quant_hand_and_roundtrip():
    x = np.zeros((129, 3), np.float32)
    x[0, 0] = 448.0 * 4  # block (0,0) amax 1792 -> s = 4
    x[1, 1] = -3.0
    x[128, 2] = 0.75  # block (1,0): amax 0.75 -> s = 2^ceil(log2(0.75/448)) = 2^-9
    q, s = Q.quant_fp8_block(x)
    np.testing.assert_array_equal(s, [[129], [127 - 9]])
    np.testing.assert_array_equal(Q.e4m3_to_float(q)[[0, 1, 128], [0, 1, 2]], [448.0, -0.75, 384.0])
    deq = Q.dequant_fp8_block(q, s)
    np.testing.assert_array_equal(deq, x)  # all values representable after scaling
    # random: dequantized value is a fixed point of quantization, error bounded by half an e4m3 ulp
    rng = np.random.default_rng(0)
    y = rng.standard_normal((200, 300)).astype(np.float32)
    q, s = Q.quant_fp8_block(y)
    d = Q.dequant_fp8_block(q, s)
    q2, s2 = Q.quant_fp8_block(d)
    np.testing.assert_array_equal(q2, q)
    np.testing.assert_array_equal(s2, s)
    assert np.max(np.abs(d - y) / np.maximum(np.abs(y), 1e-3)) < 2 ** -3


def test_fp4_unpack_hand():
    # byte 0x21: low nibble 1 (0.5) = element 0, high nibble 2 (1.0) = element 1
    # byte 0xF7: low 7 (6.0), high 0xF (-6.0); byte 0x80: low 0 (0), high 8 (-0)
    packed = np.array([[0x21, 0xF7, 0x80 - 256, 0x5B]], np.int64).astype(np.int8)
    want = np.array([[0.5, 1.0, 6.0, -6.0, 0.0, -0.0, -1.5, 3.0]], np.float32)
    np.testing.assert_array_equal(Q.unpack_fp4(packed), want)
    np.testing.assert_array_equal(Q.pack_fp4(want), packed)
    with pytest.raises(ValueError):
        Q.pack_fp4([[0.7, 1.0]])


def test_fp4_dequant_hand():
    packed = np.tile(np.array([0x21], np.uint8).view(np.int8), (1, 32))  # 64 values: 0.5, 1.0, ...
    scale = np.array([[128, 125]], np.uint8)  # 2 for k < 32, 1/4 for k >= 32
    out = Q.dequant_fp4(packed, scale)
    assert out.shape == (1, 64)
    np.testing.assert_array_equal(out[0, :4], [1.0, 2.0, 1.0, 2.0])
    np.testing.assert_array_equal(out[0, 32:36], [0.125, 0.25, 0.125, 0.25])


def test_fp4_quant_hand_and_roundtrip():
    x = np.zeros((1, 64), np.float32)
    x[0, 0], x[0, 1], x[0, 2], x[0, 3] = 12.0, -5.0, 2.9, 0.49  # amax 12 -> s = 2: 6, -2.5->-2, 1.45->1.5, .245->0
    x[0, 40] = 0.1  # amax 0.1 -> s = 2^ceil(log2(0.1/6)) = 2^-5 -> 3.2 -> 3
    p, s = Q.quant_fp4(x)
    np.testing.assert_array_equal(s, [[128, 122]])
    d = Q.dequant_fp4(p, s)
    np.testing.assert_array_equal(d[0, :4], [12.0, -4.0, 3.0, 0.0])
    assert d[0, 40] == 3.0 * 2 ** -5
    assert np.count_nonzero(d) == 4
    rng = np.random.default_rng(1)
    y = rng.standard_normal((16, 96)).astype(np.float32)
    p, s = Q.quant_fp4(y)
    d = Q.dequant_fp4(p, s)
    # dequantized values are fixed points (the encoding may differ: a block whose amax rounded down to 3*s
    # re-quantizes with scale s/2)
    np.testing.assert_array_equal(Q.dequant_fp4(*Q.quant_fp4(d)), d)
    np.testing.assert_array_equal(Q.dequant_fp4(Q.pack_fp4(Q.unpack_fp4(p)), s), d)


def test_jnp_versions_match_numpy():
    rng = np.random.default_rng(2)
    y = rng.standard_normal((130, 70)).astype(np.float32)
    q, s = Q.quant_fp8_block(y)
    np.testing.assert_array_equal(np.asarray(Q.dequant_fp8_block_jnp(q, s)), Q.dequant_fp8_block(q, s))
    p, s = Q.quant_fp4(y)
    np.testing.assert_array_equal(np.asarray(Q.dequant_fp4_jnp(p, s)), Q.dequant_fp4(p, s))
