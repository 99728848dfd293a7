"""KV-cache byte accounting against spec §4 (per-row formats, compressor states, §4.5 per-token budget)."""

import pytest

from dsv4_jax import accounting as acc
from dsv4_jax.config import tiny, v4_flash, v4_pro


def test_row_formats_match_spec():
    c = v4_flash()
    assert acc.kv_row_bytes(c, "bf16") == 1024
    assert acc.kv_row_bytes(c, "fp8") == 584  # 448 e4m3 + 64 bf16 + 7 ue8m0 + 1 pad
    assert acc.indexer_row_bytes(c, "bf16") == 256
    assert acc.indexer_row_bytes(c, "fp8") == 132
    assert acc.indexer_row_bytes(c, "fp4") == 68


def test_compressor_state_bytes_match_spec_4_1():
    assert acc.compressor_state_bytes(4, 512, overlap=True) == 64 * 1024  # CSA main
    assert acc.compressor_state_bytes(4, 128, overlap=True) == 16 * 1024  # CSA indexer
    assert acc.compressor_state_bytes(128, 512, overlap=False) == 512 * 1024  # HCA


@pytest.mark.parametrize("cfg,idx,expected", [
    (v4_flash, "fp8", 3850.25), (v4_flash, "fp4", 3514.25),
    (v4_pro, "fp8", 5511.4375), (v4_pro, "fp4", 5031.4375),
])
def test_per_token_bytes_spec_4_5(cfg, idx, expected):
    assert acc.per_token_bytes(cfg(), "fp8", idx) == expected
    by = acc.per_token_bytes_by_type(cfg(), "fp8", idx)
    assert by["sliding"] == 0
    c = cfg()
    n_csa, n_hca = c.layer_types.count("csa"), c.layer_types.count("hca")
    assert by["csa"] == n_csa * (179 if idx == "fp8" else 163)
    assert by["hca"] == n_hca * 4.5625


def test_spec_rounded_pro_figures():
    assert round(acc.per_token_bytes(v4_pro(), "fp8", "fp8"), 2) == 5511.44
    assert round(acc.per_token_bytes(v4_pro(), "fp8", "fp4"), 2) == 5031.44


def test_cache_bytes_breakdown_flash_1m():
    c = v4_flash()
    L = 1 << 20
    cb = acc.cache_bytes(c, L, kv_dtype="fp8", indexer_dtype="fp8")
    csa, hca, sw = cb.by_type["csa"], cb.by_type["hca"], cb.by_type["sliding"]
    assert (sw.num_layers, csa.num_layers, hca.num_layers) == (2, 21, 20)
    assert sw.total == 2 * 128 * 584
    assert csa.window == hca.window // 20 * 21 == 21 * 128 * 584
    assert csa.compressed_kv == 21 * (L // 4) * 584
    assert csa.indexer_keys == 21 * (L // 4) * 132
    assert hca.compressed_kv == 20 * (L // 128) * 584
    assert csa.compressor_state == 21 * (64 + 16) * 1024
    assert hca.compressor_state == 20 * 512 * 1024
    # long-context part equals per_token_bytes * L
    long_part = csa.compressed_kv + csa.indexer_keys + hca.compressed_kv
    assert long_part == acc.per_token_bytes(c, "fp8", "fp8") * L
    assert cb.total == sw.total + csa.total + hca.total == cb["total"]
    assert cb.dense_mla == 43 * L * 584
    assert cb.dense_mla > 6 * cb.total
    d = cb.as_dict()
    assert d["csa"]["total"] == csa.total and d["total"] == cb.total


def test_cache_bytes_batch_and_dtypes_scale():
    c = tiny()
    one = acc.cache_bytes(c, 100)
    four = acc.cache_bytes(c, 100, batch_size=4)
    assert four.total == 4 * one.total and four.dense_mla == 4 * one.dense_mla
    assert acc.cache_bytes(c, 100, kv_dtype="fp8").total < one.total
    # tiny: head_dim 64 (48 nope + 16 rope): 48 + 32 + 8 scale-area bytes
    assert acc.kv_row_bytes(c, "fp8") == 88
    # compressed entries count complete windows only
    assert acc.cache_bytes(c, 7).by_type["csa"].compressed_kv == 1 * 128
    assert acc.cache_bytes(c, 3).by_type["csa"].compressed_kv == 0


def test_bad_dtypes_rejected():
    with pytest.raises(ValueError, match="kv_dtype"):
        acc.cache_bytes(tiny(), 10, kv_dtype="fp4")
    with pytest.raises(ValueError, match="indexer_dtype"):
        acc.cache_bytes(tiny(), 10, indexer_dtype="int8")
    with pytest.raises(ValueError):
        acc.cache_bytes(tiny(), -1)


def test_pytree_bytes():
    import jax.numpy as jnp
    tree = {"a": jnp.zeros((3, 4), jnp.float32), "b": [jnp.zeros((5,), jnp.bfloat16)]}
    assert acc.pytree_bytes(tree) == 48 + 10
