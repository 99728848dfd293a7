"""The cache's declared device layouts (`dsv4_jax.cache.cache_layouts` / `place_cache`).

On a TPU the kernels take the cache's arrays row-major (8-bit ones tiled (8, 128)(4, 1)), unlike XLA's defaults
there, so `generate` and `model.prefill` / `model.decode` place the cache in those layouts and compile their steps to
return it in them (benchmarks/tpu_offline.py's `engine_*` cases show the copies that removes). No TPU here: the
plumbing is exercised on the CPU with a rule that declares every array column-major (not the CPU's default), and the
results must equal the default path's bit for bit, with no recompilation on a second call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.layout import Layout

import dsv4_jax
from dsv4_jax import cache as cache_lib
from dsv4_jax import engine


def _column_major(leaf):
    return Layout(major_to_minor=tuple(reversed(range(leaf.ndim)))) if leaf.ndim >= 2 else None


@pytest.fixture(scope="module")
def model():
    return dsv4_jax.load_pretrained(dsv4_jax.embedded_checkpoint_path(), progress=False)


@pytest.fixture
def cpu_rule(monkeypatch):
    monkeypatch.setitem(cache_lib.CACHE_LAYOUT_RULES, "cpu", _column_major)


def test_tpu_rule_declares_the_kernels_layouts(model):
    cache = model.init_cache(2, 256, kv_dtype="bf16", indexer_dtype="fp4")
    leaves = jax.tree_util.tree_leaves(cache)
    layouts = cache_lib.cache_layouts(cache, "tpu")
    assert len(layouts) == len(leaves)
    n_tiled = 0
    for leaf, layout in zip(leaves, layouts):
        if leaf.ndim < 2:
            assert layout is None
            continue
        assert layout.major_to_minor == tuple(range(leaf.ndim))   # row-major, as a Mosaic operand
        eight_bit = jnp.dtype(leaf.dtype).itemsize == 1 and leaf.shape[-2] % 8 == 0
        assert (layout.tiling == cache_lib.TPU_KERNEL_TILING_8BIT) == eight_bit, leaf.shape
        n_tiled += eight_bit
    assert n_tiled > 0   # the fp4 indexer keys and their scales
    # XLA's defaults are the kernels' layouts on the GPU and the CPU: nothing declared, nothing placed
    assert cache_lib.cache_layouts(cache, "gpu") is None
    placed, formats = cache_lib.place_cache(cache)
    assert placed is cache and formats is None


def test_place_cache_moves_each_array_once(model, cpu_rule):
    cache = model.init_cache(2, 64)
    placed, formats = cache_lib.place_cache(cache)
    assert len(jax.tree_util.tree_leaves(formats)) == len(jax.tree_util.tree_leaves(cache))
    for a, b in zip(jax.tree_util.tree_leaves(cache), jax.tree_util.tree_leaves(placed)):
        want = tuple(reversed(range(a.ndim))) if a.ndim >= 2 else tuple(range(a.ndim))
        assert b.format.layout.major_to_minor == want
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    again, _ = cache_lib.place_cache(placed)
    assert all(x is y for x, y in zip(jax.tree_util.tree_leaves(placed), jax.tree_util.tree_leaves(again)))


def test_prefill_decode_keep_the_declared_layouts(model, cpu_rule, monkeypatch):
    ids = np.array([[5, 9, 2, 7, 1], [3, 8, 4, 6, 2]])
    cache = model.init_cache(2, 64, kv_dtype="bf16", indexer_dtype="fp8")
    logits, cache = model.prefill(ids, cache)
    step_logits, cache = model.decode(np.array([11, 12]), cache)
    for leaf in jax.tree_util.tree_leaves(cache):
        if leaf.ndim >= 2:
            assert leaf.format.layout.major_to_minor == tuple(reversed(range(leaf.ndim)))
    monkeypatch.delitem(cache_lib.CACHE_LAYOUT_RULES, "cpu")
    ref_logits, ref_cache = model.prefill(ids, model.init_cache(2, 64, kv_dtype="bf16", indexer_dtype="fp8"))
    ref_step, ref_cache = model.decode(np.array([11, 12]), ref_cache)
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(ref_logits))
    np.testing.assert_array_equal(np.asarray(step_logits), np.asarray(ref_step))
    for a, b in zip(jax.tree_util.tree_leaves(cache), jax.tree_util.tree_leaves(ref_cache)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_generate_with_declared_layouts(model, cpu_rule, monkeypatch):
    prompts = [[17, 4, 99, 23, 5, 61], [8, 40, 2]]
    tokens = dsv4_jax.generate(model, prompts, 7, temperature=0.8, seed=3)
    before = engine.compile_count()
    assert dsv4_jax.generate(model, prompts, 7, temperature=0.8, seed=3) == tokens
    assert engine.compile_count() == before   # the placed cache's layouts are part of no new program
    monkeypatch.delitem(cache_lib.CACHE_LAYOUT_RULES, "cpu")
    assert dsv4_jax.generate(model, prompts, 7, temperature=0.8, seed=3) == tokens
