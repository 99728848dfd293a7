"""The grouped matmul (`pallas_kernels/grouped_matmul`): the Triton kernel in the Pallas interpreter against the
reference (XLA's ragged dot) with fresh random inputs, its work-item list, its CUDA lowering, its errors; the TPU
path (megablox) in the TPU interpreter (its TPU lowering: tests/test_tpu_lowering.py); on a GPU the compiled kernel
at V4-Flash expert shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.grouped_matmul import grouped_matmul, grouped_matmul_gpu, work_items
from pallas_kernels.grouped_matmul.gpu import fit_block
from tiers import core, sweep

ON_GPU = jax.default_backend() == "gpu"


def _case(rng, sizes, K, N, dtype, extra_rows=0):
    sizes = np.asarray(sizes, np.int32)
    M = int(sizes.sum()) + extra_rows
    lhs = jnp.asarray(rng.standard_normal((M, K)), dtype)
    rhs = jnp.asarray(rng.standard_normal((len(sizes), K, N)) * K ** -0.5, dtype)
    return lhs, rhs, jnp.asarray(sizes)


@pytest.mark.parametrize("sizes,extra,opts,dtype", sweep([
    core([0, 5, 17, 0, 1, 30, 0, 3], 4, {}, jnp.bfloat16),              # empty groups, boundaries inside tiles
    core([40], 0, dict(block_m=32, block_n=64, block_k=32), jnp.float32),   # one group over several tiles
    ([1] * 12, 0, {}, jnp.bfloat16),                                     # a group per row: 12 items in one tile
    ([0, 0, 64, 0], 0, dict(block_m=64), jnp.bfloat16),                  # tile-aligned
    ([3, 0, 0, 0, 0, 0, 0, 9], 7, dict(block_m=16, block_n=128, block_k=128), jnp.float32),
]))
def test_kernel_matches_reference(sizes, extra, opts, dtype):
    """Interpreted kernel == reference: f32 to rounding, bf16 products to f32-accumulation order; rows past the
    groups (`extra`) are 0 as in the reference."""
    rng = np.random.default_rng(len(sizes) * 7 + extra)
    lhs, rhs, gs = _case(rng, sizes, 128, 256, dtype, extra)
    want = np.asarray(grouped_matmul(lhs, rhs, gs, impl="reference"))
    got = np.asarray(grouped_matmul(lhs, rhs, gs, impl="pallas", **opts))
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    if extra:
        assert np.all(got[-extra:] == 0)


@pytest.mark.parametrize("sizes,extra,dtype", [([0, 5, 17, 0, 1, 30, 0, 3], 4, jnp.float32),
                                               ([3, 0, 0, 130], 0, jnp.bfloat16)])
def test_tpu_kernel_matches_reference(sizes, extra, dtype):
    """The TPU path (megablox's grouped matmul, Pallas' TPU interpreter) == reference; rows past the groups 0."""
    rng = np.random.default_rng(sum(sizes))
    lhs, rhs, gs = _case(rng, sizes, 128, 256, dtype, extra)
    want = np.asarray(grouped_matmul(lhs, rhs, gs, impl="reference"))
    got = np.asarray(grouped_matmul(lhs, rhs, gs, impl="interpret_tpu"))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    if extra:
        assert np.all(got[-extra:] == 0)


def test_work_items_cover_each_group_tile_pair_once():
    """Every (group, M tile) pair holding rows of the group is one item, in group order; the rest are -1."""
    rng = np.random.default_rng(3)
    for _ in range(20):
        E, bm = int(rng.integers(1, 12)), int(rng.choice([16, 32, 64]))
        sizes = rng.integers(0, 40, E) * (rng.random(E) < 0.6)
        M = int(sizes.sum()) + int(rng.integers(0, 5))
        g, t, off = (np.asarray(a) for a in work_items(jnp.asarray(sizes, jnp.int32), max(M, 1), bm))
        want = [(e, tile) for e in range(E) if sizes[e]
                for tile in range(off[e] // bm, (off[e + 1] - 1) // bm + 1)]
        got = [(int(a), int(b)) for a, b in zip(g, t) if a >= 0]
        assert got == want
        assert len(g) == -(-max(M, 1) // bm) + E and np.all(g[len(got):] == -1)
        np.testing.assert_array_equal(off, np.concatenate([[0], np.cumsum(sizes)]))
    # sizes summing past M (a caller's error) stay inside lhs: the last group is cut at M
    g, t, off = (np.asarray(a) for a in work_items(jnp.asarray([5, 30, 40], jnp.int32), 40, 16))
    assert off.tolist() == [0, 5, 35, 40] and t[g >= 0].max() == 2


def test_grouped_matmul_lowers_for_cuda():
    """The kernel lowers for CUDA at a V4-Flash decode shape (96 token x expert rows, 256 experts, 4096 x 2048)
    and at a prefill-like one with 64-row tiles."""
    from test_gpu_lowering import lowers_for

    gs = jax.ShapeDtypeStruct((256,), jnp.int32)
    for M, K, N, opts in [(96, 4096, 2048, {}), (4096, 2048, 4096, dict(block_m=64, block_n=128, block_k=64))]:
        lhs = jax.ShapeDtypeStruct((M, K), jnp.bfloat16)
        rhs = jax.ShapeDtypeStruct((256, K, N), jnp.bfloat16)
        text = lowers_for("cuda", "triton", lambda a, b, c: grouped_matmul_gpu(a, b, c, **opts), lhs, rhs, gs)
        assert "grouped_matmul_m" in text


def test_grouped_matmul_errors():
    rng = np.random.default_rng(0)
    lhs, rhs, gs = _case(rng, [3, 5], 64, 128, jnp.float32)
    with pytest.raises(ValueError, match="must agree"):
        grouped_matmul_gpu(lhs[:, :32], rhs, gs, interpret=True)
    with pytest.raises(ValueError, match="multiple of block_k"):
        grouped_matmul_gpu(lhs, rhs, gs, block_k=48, interpret=True)
    with pytest.raises(ValueError, match="share a dtype"):
        grouped_matmul_gpu(lhs.astype(jnp.bfloat16), rhs, gs, interpret=True)
    with pytest.raises(ValueError, match="apply to the kernels only"):
        grouped_matmul(lhs, rhs, gs, impl="reference", block_m=32)
    with pytest.raises(ValueError, match="impl must be"):
        grouped_matmul(lhs, rhs, gs, impl="xla")
    # default blocks narrow to a divisor; a dim that is no multiple of 16 is refused, not padded behind one's back
    assert [fit_block(128, n, "N") for n in (4096, 96, 48, 16)] == [128, 32, 16, 16]
    lhs24, rhs24, gs24 = _case(rng, [3, 5], 24, 128, jnp.float32)
    with pytest.raises(ValueError, match="K = 24 is not a multiple of 16"):
        grouped_matmul_gpu(lhs24, rhs24, gs24, interpret=True)


def test_routed_experts_on_the_kernel_match_the_reference():
    """The model's routed-expert forward (`layers.moe.routed_experts`) with the grouped matmul on the kernel
    (interpreted; compiled on a GPU) equals it on the reference: routing with empty and shared experts, dims that
    the default blocks do not divide (96 = 3 x 32, 48 = 3 x 16)."""
    from dsv4_jax.layers.moe import routed_experts

    rng = np.random.default_rng(11)
    T, k, E, D, I = 10, 3, 8, 96, 48
    x = jnp.asarray(rng.standard_normal((T, D)), jnp.float32)
    experts = jnp.asarray(np.stack([rng.choice(6, k, replace=False) for _ in range(T)]), jnp.int32)  # 6, 7 unused
    weights = jnp.asarray(rng.random((T, k)), jnp.float32)
    w1, w3 = (jnp.asarray(rng.standard_normal((E, D, I)) * D ** -0.5, jnp.float32) for _ in range(2))
    w2 = jnp.asarray(rng.standard_normal((E, I, D)) * I ** -0.5, jnp.float32)
    want = routed_experts(x, weights, experts, w1, w3, w2, 10.0)
    got = routed_experts(x, weights, experts, w1, w3, w2, 10.0, gmm_impl="pallas")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    out_in = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [2]), ([], [])),
                                               lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
    with pytest.raises(ValueError, match="take \\[E, in, out\\] weights"):   # no silent fallback to ragged_dot
        routed_experts(x, weights, experts, w1, w3, w2, 10.0, dims=out_in, gmm_impl="pallas")


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU (the compiled Triton kernel)")
@pytest.mark.parametrize("T,E,opts", [(16, 256, {}), (64, 256, {}), (16, 8, {}), (512, 64, dict(block_m=64)),
                                      (16, 256, dict(block_n=64, block_k=128))])
def test_gpu_grouped_matmul_v4_flash_shapes(T, E, opts):
    """Compiled, V4-Flash expert shapes (4096 x 2048 and back), top-6 routing of T tokens over E experts: the
    kernel against the reference, w1-like and w2-like."""
    rng = np.random.default_rng(T + E)
    flat = np.sort(np.concatenate([rng.choice(E, 6, replace=False) for _ in range(T)]))
    gs = jnp.asarray(np.bincount(flat, minlength=E), jnp.int32)
    for K, N in ((4096, 2048), (2048, 4096)):
        lhs = jnp.asarray(rng.standard_normal((6 * T, K)), jnp.bfloat16)
        rhs = jnp.asarray(rng.standard_normal((E, K, N)) * K ** -0.5, jnp.bfloat16)
        want = np.asarray(grouped_matmul(lhs, rhs, gs, impl="reference"))
        got = np.asarray(grouped_matmul(lhs, rhs, gs, impl="pallas", **opts))
        np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3 * np.abs(want).max())


def test_auto_takes_the_kernel_only_where_it_applies(monkeypatch):
    """impl "auto" on a GPU / TPU: the kernel for shapes it takes, XLA's ragged dot for others (K or N no multiple
    of 16 on the GPU, not of 128 past 128 on the TPU: a custom small model config), so every model config runs;
    "pallas" there raises instead."""
    import pallas_kernels.grouped_matmul as gm

    rng = np.random.default_rng(5)
    calls = []
    for where, (K, N) in (("gpu", (24, 40)), ("tpu", (200, 64))):   # shapes that kernel does not take
        monkeypatch.setattr(gm, "_resolve", lambda impl, *a, where=where, **kw: where if impl != "reference"
                            else "reference")
        monkeypatch.setattr(gm, f"grouped_matmul_{where}", lambda *a, where=where, **kw: calls.append(where) or
                            "kernel")
        lhs, rhs, gs = _case(rng, [3, 5], 64, 32, jnp.float32)
        assert gm.grouped_matmul(lhs, rhs, gs, impl="auto") == "kernel"
        lhs, rhs, gs = _case(rng, [3, 5], K, N, jnp.float32)
        want = np.asarray(gm.grouped_matmul(lhs, rhs, gs, impl="reference"))
        np.testing.assert_array_equal(np.asarray(gm.grouped_matmul(lhs, rhs, gs, impl="auto")), want)
    assert calls == ["gpu", "tpu"]
    from pallas_kernels.grouped_matmul import gpu, tpu

    assert gpu.kernel_applies(4096, 2048) and not gpu.kernel_applies(24, 64) and not gpu.kernel_applies(64, 40)
    assert tpu.kernel_applies(4096, 2048) and tpu.kernel_applies(96, 64) and not tpu.kernel_applies(200, 64)
    lhs24, rhs24, gs24 = _case(rng, [3, 5], 24, 128, jnp.float32)
    with pytest.raises(ValueError, match="not a multiple of 16"):
        grouped_matmul_gpu(lhs24, rhs24, gs24, interpret=True)
