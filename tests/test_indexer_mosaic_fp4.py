"""fp4 keys on the Mosaic indexer kernel (`pallas_kernels/indexer/mosaic_fp4.py`): the register plan derived from
Mosaic GPU's layouts, the nibble decode's bit model, the group factors, and the whole arithmetic (decode x factor
in the plan's column order against q permuted the same way, x the key's score factor) against the reference scores
in numpy. The kernel itself runs only compiled (tests/test_indexer_kernels.py::test_gpu_mosaic_fp4_scores on a
GPU; tests/test_gpu_lowering.py lowers it for CUDA here)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.indexer import formats as F, indexer_scores
from pallas_kernels.indexer.mosaic_fp4 import (ASM_CHANNELS, fp4_f16x4_reference, group_factor_bits,
                                               register_plan)


def e2m1(nib):
    mag = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float64)[nib & 7]
    return np.where(nib & 8, -mag, mag)


@pytest.mark.parametrize("rows", [64, 128, 192, 256])
def test_register_plan_is_one_permutation(rows):
    """register_plan checks every thread itself (same row, 4 consecutive bytes of one group, one channel -> column
    map); here: the map is a permutation, the same for every block height, and each target register appears once."""
    plan, columns = register_plan(rows)
    assert sorted(columns.tolist()) == list(range(128))
    np.testing.assert_array_equal(columns, register_plan(64)[1])
    targets = [t for _, ts, _, _ in plan for t in ts]
    assert len(targets) == len(set(targets)) == rows * 128 // 128 // 2   # f16x2 registers per thread
    assert sorted(g for *_, g in plan) == sorted(list(range(4)) * (len(plan) // 4))


def test_nibble_decode_model_every_byte():
    """FP4_F16X4_SCALED_ASM's model: every byte value in each of the 4 positions of a word, factor 1 and 2^-9:
    e2m1 x 2^-14 x factor exactly, channels in ASM_CHANNELS order."""
    rng = np.random.default_rng(0)
    words = rng.integers(0, 2 ** 32, 256, dtype=np.uint64).astype(np.uint32)
    words[:256] = (words[:256] & ~np.uint32(0xFF)) | np.arange(256, dtype=np.uint32)
    for factor in (1.0, 2.0 ** -9, 2.0 ** 15):
        bits = np.full(words.shape, np.float16(factor).view(np.uint16))
        got = fp4_f16x4_reference(words, bits).astype(np.float64)
        for r, chans in enumerate(ASM_CHANNELS):
            for h, ch in enumerate(chans):
                nib = (words >> (4 * ch)) & 0xF
                np.testing.assert_array_equal(got[:, r, h], e2m1(nib.astype(np.int64)) * 2.0 ** -14 * factor)


def test_group_factors():
    s = np.array([[127, 127, 127, 127], [130, 100, 127, 91], [10, 50, 60, 5], [0, 0, 0, 0], [254, 200, 225, 160]])
    bits, shift = group_factor_bits(s)
    f = bits.view(np.float16).astype(np.float64)
    d = s.max(-1, keepdims=True) - s
    want = np.where(d <= 39, 2.0 ** (15 - d), 0.0)
    np.testing.assert_array_equal(f, want)
    np.testing.assert_array_equal(shift, s.max(-1) - 128)


def model_scores(q, w, keys, nv):
    """The Mosaic fp4 path's arithmetic in numpy (f16 operands and factors exactly as the kernel forms them, f64
    sums): q per (token, head) / 2^e in f16 in the plan's column order; keys decoded x group factor into the same
    columns; ReLU, head weights x 2^e, x 2^(smax - 128)."""
    _, columns = register_plan(128)
    q = np.asarray(q, np.float64)
    amax = np.abs(q).max(-1)
    _, e = np.frexp(amax)
    e = np.where(amax > 0, e, 0)
    q_op = np.zeros_like(q)
    q_op[..., columns] = (q * np.ldexp(1.0, -e)[..., None]).astype(np.float16)
    wf = np.asarray(w, np.float64) * np.ldexp(1.0, e)
    packed = np.asarray(keys.values).astype(np.uint32)            # [B, T, 64]
    bits, shift = group_factor_bits(np.asarray(keys.scale))        # [B, T, 4], [B, T]
    B, T = packed.shape[:2]
    words = packed.reshape(B, T, 16, 4)
    words = words[..., 0] | (words[..., 1] << 8) | (words[..., 2] << 16) | (words[..., 3] << 24)   # [B, T, 16]
    fac = np.repeat(bits, 4, axis=-1)                              # word i is in group i // 4
    vals = fp4_f16x4_reference(words, fac).astype(np.float64)      # [B, T, 16, 4, 2]
    k_op = np.zeros((B, T, 128))
    for r, chans in enumerate(ASM_CHANNELS):
        for h, ch in enumerate(chans):
            k_op[..., columns[np.arange(16) * 8 + ch]] = vals[..., r, h]
    logits = np.einsum("bshc,btc->bsht", q_op, k_op)
    s = np.einsum("bsht,bsh->bst", np.maximum(logits, 0), wf) * np.ldexp(1.0, shift)[:, None, :]
    t = np.arange(T)
    return np.where(t[None, None] < np.asarray(nv)[..., None], s, -np.inf)


@pytest.mark.parametrize("operand", ["f16", "e5m2"])
@pytest.mark.parametrize("spread", [0, 12, 22])
def test_model_matches_reference(spread, operand):
    """The arithmetic the kernel runs (`model_scores`: f16 operands; `model_scores_e5m2`: precision "fp8", the fp8
    tensor cores' accumulation order aside) equals the reference scores to f32 rounding, also with each key's groups
    spread over 2^spread (scaled channels groups) and one all-zero key."""
    rng = np.random.default_rng(spread + (100 if operand == "e5m2" else 0))
    B, S, H, T = 2, 1, 16, 64
    q = F.fake_quantize(F.hadamard(jnp.asarray(rng.standard_normal((B, S, H, 128)), jnp.float32)), "fp4")
    k = rng.standard_normal((B, T, 128))
    k = k * np.ldexp(1.0, -rng.integers(0, spread + 1, (B, T, 4)).repeat(32, -1))
    k[0, 3] = 0
    keys = F.quantize(jnp.asarray(k, jnp.float32), "fp4")
    w = jnp.asarray(rng.standard_normal((B, S, H)), jnp.float32)
    nv = jnp.asarray([[T], [T - 5]], jnp.int32)
    ref = np.asarray(indexer_scores(q, w, keys, nv), np.float64)
    got = (model_scores if operand == "f16" else model_scores_e5m2)(q, w, keys, nv)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(ref))
    fin = np.isfinite(ref)
    np.testing.assert_allclose(got[fin], ref[fin], rtol=1e-5, atol=1e-6 * np.abs(ref[fin]).max())


# ------------------------------------------------------------------ precision "fp8": e5m2 operands (session 45)
def _words(packed):
    """packed uint8 [..., 64] -> uint32 words [..., 16] (4 bytes each, little-endian)."""
    w = np.asarray(packed).astype(np.uint32).reshape(packed.shape[:-1] + (16, 4))
    return w[..., 0] | (w[..., 1] << 8) | (w[..., 2] << 16) | (w[..., 3] << 24)


@pytest.mark.parametrize("rows", [64, 128, 192, 256])
def test_register_plan_e5m2_keeps_groups_in_k_steps(rows):
    """The e5m2 operand's plan (WGMMA_LAYOUT_8BIT, 2 registers of 4 per source register): one permutation for every
    block height, each target register once, and every 32-channel scale group in its own 32 columns, i.e. one e5m2
    wgmma K-step (K = 32) per group, so an instruction's products share their groups' scales."""
    plan, columns = register_plan(rows, "e5m2")
    assert sorted(columns.tolist()) == list(range(128))
    np.testing.assert_array_equal(columns, register_plan(64, "e5m2")[1])
    targets = [t for _, ts, _, _ in plan for t in ts]
    assert len(targets) == len(set(targets)) == rows * 128 // 128 // 4   # e5m2x4 registers per thread
    np.testing.assert_array_equal(columns // 32, np.arange(128) // 32)


def test_e5m2_asm_matches_its_model_in_the_ptx_interpreter():
    """FP4_E5M2X8_ASM and E5M2_LUTS_ASM run in tests/ptx_sim.py (prmt's table and sign-replicate modes, bfe) equal
    their numpy models: every byte value in every position of a word, random tables; scale words with groups 0, 26,
    27 and 255 below the largest, and the factor's subnormal range (largest scale < 14)."""
    from ptx_sim import run_registers

    from pallas_kernels.indexer.mosaic_fp4 import (E5M2_LUTS_ASM, FP4_E5M2X8_ASM, e5m2_luts,
                                                   fp4_e5m2x8_reference)

    rng = np.random.default_rng(45)
    words = rng.integers(0, 2 ** 32, 64, dtype=np.uint64).astype(np.uint32)
    words[:32] = (np.arange(32, dtype=np.uint32) * 0x08) * 0x01010101 + np.arange(32, dtype=np.uint32)
    scales = np.concatenate([rng.integers(0, 256, (24, 4)),
                             [[127, 101, 100, 0], [13, 13, 0, 5], [255, 229, 228, 0], [0, 0, 0, 0], [6, 7, 8, 9]]])
    tables, factor = e5m2_luts(scales)
    for i, sc in enumerate(scales):
        word = int(sc[0]) | int(sc[1]) << 8 | int(sc[2]) << 16 | int(sc[3]) << 24
        got = run_registers(E5M2_LUTS_ASM, [word], 9)
        assert got[:8] == tables[i].ravel().tolist(), (sc, [hex(g) for g in got])
        assert got[8] == int(factor[i]), (sc, hex(got[8]))
        for wd in words[i::len(scales)][:3]:
            lo, hi = tables[i, i % 4]
            out = run_registers(FP4_E5M2X8_ASM, [int(wd), int(lo), int(hi)], 2)
            want = fp4_e5m2x8_reference(np.array([wd]), np.array([lo]), np.array([hi]))[0]
            assert out == [int(want[r].view(np.uint32)[0]) for r in range(2)], hex(int(wd))


@pytest.mark.parametrize("layout", ["fragments", "rows"])
def test_converter_model_equals_the_asm_bit_for_bit(layout):
    """fp4_converter's interpreter model (`gpu_mosaic._fp4_e5m2_values`, jnp) gives the bytes the compiled
    converter stores: every key's e5m2 operand row equal to the inline PTX's numpy model (`e5m2_luts` tables,
    `fp4_e5m2x8_reference`) placed in the register plan's columns, and the same key factor bits; scale spreads around
    E5M2_MAX_D, every nibble code, the factor's subnormal range. fp4_layout "rows" (`fp4_operand_rows`): the asm's
    two output words of source word k of vector c go to operand vector 2c + k // 2 at bytes 8 (k % 2) .. + 7, i.e.
    channel order."""
    import jax

    from pallas_kernels.indexer.gpu_mosaic import _fp4_e5m2_values
    from pallas_kernels.indexer.mosaic_fp4 import E5M2_ASM_CHANNELS, e5m2_luts, fp4_e5m2x8_reference

    _, columns = register_plan(64, "e5m2")
    rng = np.random.default_rng(49)
    n = 512
    packed = rng.integers(0, 256, (n, 64), dtype=np.uint8)
    packed[:16] = np.arange(256, dtype=np.uint8).reshape(4, 64).repeat(4, 0)
    scales = rng.integers(0, 256, (n, 4))
    scales[: n // 2] = np.clip(scales[: n // 2, :1] - rng.integers(0, 30, (n // 2, 4)), 0, 255)
    scales[-4:] = [[13, 13, 0, 5], [0, 0, 0, 0], [6, 7, 8, 9], [255, 228, 229, 0]]
    words = (scales[:, 0] | scales[:, 1] << 8 | scales[:, 2] << 16 | scales[:, 3] << 24).astype(np.uint32)
    rows = layout == "rows"
    vals, factor = jax.jit(lambda p, s: _fp4_e5m2_values(p, s, rows_order=rows))(
        jnp.asarray(packed), jnp.asarray(words.view(np.int32)))
    got = np.asarray(vals).view(np.uint8)
    tables, fbits = e5m2_luts(scales)
    want = np.zeros((n, 128), np.uint8)
    w = _words(packed)
    for k in range(16):   # word k: channels 8k .. 8k + 7, group k // 4
        b = fp4_e5m2x8_reference(w[:, k], tables[:, k // 4, 0], tables[:, k // 4, 1])   # [n, 2, 4]
        if rows:   # source vector c = k // 4, its word k % 4 -> operand vector 2c + (k % 4) // 2, bytes 8 (k % 2)..
            c, kk = divmod(k, 4)
            start = 16 * (2 * c + kk // 2) + 8 * (kk % 2)
            want[:, start:start + 8] = b.reshape(n, 8)
            continue
        for r, chans in enumerate(E5M2_ASM_CHANNELS):
            for i, ch in enumerate(chans):
                want[:, columns[8 * k + ch]] = b[:, r, i]
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.asarray(factor).view(np.uint32), fbits)


def test_e5m2_operand_values_exact():
    """The e5m2 bytes x the key's factor are the key's dequantized values exactly for groups <= E5M2_MAX_D below its
    largest, 0 beyond; both signs, every code, the factor's normal and subnormal range."""
    import ml_dtypes

    from pallas_kernels.indexer.mosaic_fp4 import E5M2_MAX_D, e5m2_luts, fp4_e5m2x8_reference

    rng = np.random.default_rng(7)
    n = 4000
    scales = rng.integers(0, 256, (n, 4))
    scales[: n // 2] = scales[: n // 2, :1] - rng.integers(0, 30, (n // 2, 4))   # spreads around the cut-off
    scales = np.clip(scales, 0, 255)
    words = rng.integers(0, 2 ** 32, (n, 4), dtype=np.uint64).astype(np.uint32)   # 8 channels of each group
    tables, fbits = e5m2_luts(scales)
    factor = fbits.view(np.float32).astype(np.float64)
    smax = scales.max(-1)
    for g in range(4):
        b = fp4_e5m2x8_reference(words[:, g], tables[:, g, 0], tables[:, g, 1]).reshape(n, 8)
        vals = b.view(ml_dtypes.float8_e5m2).astype(np.float64) * factor[:, None]
        nib = (words[:, g, None].astype(np.int64) >> (4 * np.arange(8))) & 0xF
        want = e2m1(nib) * np.ldexp(1.0, scales[:, g, None] - 127)
        keep = (smax - scales[:, g]) <= E5M2_MAX_D
        np.testing.assert_array_equal(vals[keep], want[keep])
        assert np.all(vals[~keep] == 0)


def model_scores_e5m2(q, w, keys, nv):
    """The precision-"fp8" fp4 path's arithmetic in numpy: q's e5m2 codes (`gpu.quantize_q_fp8`) and the keys'
    e5m2 bytes (`e5m2_luts`, `fp4_e5m2x8_reference`) both in the plan's column order, products summed in f64 (the
    tensor cores' own accumulation aside), ReLU, weights x q's scale, x 2^(smax - 140)."""
    import ml_dtypes

    from pallas_kernels.indexer.gpu import quantize_q_fp8
    from pallas_kernels.indexer.mosaic_fp4 import E5M2_ASM_CHANNELS, e5m2_luts, fp4_e5m2x8_reference

    _, columns = register_plan(128, "e5m2")
    q8, qs = quantize_q_fp8(jnp.asarray(q, jnp.float32), "fp4")
    q_op = np.zeros(q8.shape)
    q_op[..., columns] = np.asarray(q8).astype(np.float64)
    wf = np.asarray(w, np.float64) * np.asarray(qs, np.float64)
    words = _words(np.asarray(keys.values))                            # [B, T, 16]
    tables, fbits = e5m2_luts(np.asarray(keys.scale))                  # [B, T, 4, 2], [B, T]
    B, T = words.shape[:2]
    k_op = np.zeros((B, T, 128))
    for i in range(16):   # word i holds channels 8i .. 8i + 7, in group i // 4
        t = tables[:, :, i // 4]
        b = fp4_e5m2x8_reference(words[..., i], t[..., 0], t[..., 1]).view(ml_dtypes.float8_e5m2)
        for r, chans in enumerate(E5M2_ASM_CHANNELS):
            for h, ch in enumerate(chans):
                k_op[..., columns[8 * i + ch]] = b[..., r, h].astype(np.float64)
    logits = np.einsum("bshc,btc->bsht", q_op, k_op)
    factor = fbits.view(np.float32).astype(np.float64)
    s = np.einsum("bsht,bsh->bst", np.maximum(logits, 0), wf) * factor[:, None, :]
    return np.where(np.arange(T)[None, None] < np.asarray(nv)[..., None], s, -np.inf)


def test_fp4_asm_blocks_assemble(tmp_path):
    """Every inline-PTX block of `mosaic_fp4` (both operands' conversions and factor / table blocks) assembles for
    sm_90a: a syntax or register-name error fails here, not on the GPU. Skipped where no ptxas is found."""
    import subprocess

    from test_indexer_segment_select import _ptxas

    from pallas_kernels.indexer import mosaic_fp4 as M4
    from pallas_kernels.indexer.mosaic_select import standalone_ptx

    ptxas = _ptxas()
    if not ptxas:
        pytest.skip("no ptxas (set PTXAS or pip install nvidia-cuda-nvcc-cu12)")
    blocks = [("fp4_f16x4", M4.FP4_F16X4_SCALED_ASM, "r" * 6), ("scale_factors", M4.SCALE_FACTORS_ASM, "r" * 6),
              ("fp4_e5m2x8", M4.FP4_E5M2X8_ASM, "r" * 5), ("e5m2_luts", M4.E5M2_LUTS_ASM, "r" * 10)]
    src = tmp_path / "fp4.ptx"
    src.write_text(standalone_ptx(blocks))
    res = subprocess.run([ptxas, "-arch=sm_90a", str(src), "-o", str(tmp_path / "fp4.cubin")],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("rows", [128, 256, 384])
def test_rows_layout_gives_each_thread_whole_rows(rows):
    """fp4_layout "rows": `rows_layout`'s register (i, 0, 0, c, 0, 0) is bytes 16c..16c+15 of row 128 i + t for
    every thread t, for the packed keys and the e5m2 operand (what `fp4_operand_rows` indexes by); other row counts
    are refused."""
    from pallas_kernels.indexer.mosaic_fp4 import check_rows_layout, rows_layout

    check_rows_layout(rows)
    with pytest.raises(ValueError, match="multiple of 128 rows"):
        check_rows_layout(rows + 64)
    with pytest.raises(ValueError, match="multiple of 16"):
        rows_layout(40)
