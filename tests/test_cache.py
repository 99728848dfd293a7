"""Caches, chunked prefill and decode (issue #3): any split of a sequence gives the stateless forward's logits and
the oracle's, for every layer type, ragged batches included; decode never recompiles; bad input fails clearly."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv4_jax
from dsv4_jax import model as model_lib
from dsv4_jax.config import tiny

import oracle as O

CONFIGS = {
    "sliding-csa-hca": dict(ratios=[0, 4, 8]),
    "hca-csa-sliding/learned/hc2": dict(ratios=[8, 4, 0], num_hash_layers=0, hc_mult=2),
}
CHUNK = 8  # one compiled chunk shape; split points vary through per-row lengths (0..CHUNK)


@pytest.fixture(scope="module", params=list(CONFIGS))
def loaded(request, tmp_path_factory):
    cfg = tiny(**CONFIGS[request.param])
    hf = O.make_hf_model(cfg, seed=21)
    path = tmp_path_factory.mktemp("ckpt")
    O.write_hf_layout(hf, path)
    return cfg, hf, dsv4_jax.load_pretrained(str(path), attention_impl="reference", progress=False)


def rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


def run_random_splits(model, ids, prompt_lens, rng, max_len):
    """Feeds each row's first prompt_lens[b] tokens in random ragged chunks (lengths 0..CHUNK per row and call),
    then the rest one decode step at a time. Returns logits [B, L, V] collected at every position."""
    B, L = ids.shape
    cache = model.init_cache(B, max_len)
    out = np.full(ids.shape + (model.config.vocab_size,), np.nan, np.float32)
    pos = np.zeros(B, np.int64)
    while (pos < prompt_lens).any():
        n = np.minimum(rng.integers(0, CHUNK + 1, B), prompt_lens - pos)
        chunk = np.zeros((B, CHUNK), np.int64)
        for b in range(B):
            chunk[b, : n[b]] = ids[b, pos[b]: pos[b] + n[b]]
        logits, cache = model.prefill(chunk, cache, n)
        logits = np.asarray(logits)
        for b in range(B):
            out[b, pos[b]: pos[b] + n[b]] = logits[b, : n[b]]
        pos += n
    assert (np.asarray(cache.lengths) == prompt_lens).all()
    assert (prompt_lens == prompt_lens[0]).all()
    for t in range(prompt_lens[0], L):
        logits, cache = model.decode(ids[:, t], cache)
        out[:, t] = np.asarray(logits)
    return out, cache


# default tier: the config with every layer type (the other order, the learned router and hc_mult 2 run against
# the oracle in test_model_parity; here in the full tier)
@pytest.mark.core_params(loaded=["sliding-csa-hca"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_splits_match_stateless_and_oracle(loaded, seed):
    cfg, hf, model = loaded
    rng = np.random.default_rng(seed)
    B, L = 3, 44
    ids = rng.integers(0, cfg.vocab_size, (B, L))
    prompt = int(rng.integers(1, 30))
    got, _ = run_random_splits(model, ids, np.full(B, prompt), rng, max_len=48)
    full = np.asarray(model(ids))
    ref = O.hf_logits(hf, ids)
    assert not np.isnan(got).any()
    assert rel(got, full) <= 1e-4
    assert rel(got, ref) <= 1e-4
    for t in range(L):  # every position, so a single bad boundary cannot hide behind the max
        assert rel(got[:, t], ref[:, t]) <= 1e-4 * np.abs(ref).max() / np.abs(ref[:, t]).max(), t


@pytest.mark.core_params(loaded=["sliding-csa-hca"])
def test_ragged_batch_rows_are_independent(loaded):
    cfg, hf, model = loaded
    rng = np.random.default_rng(7)
    lens = np.array([37, 5, 22])
    ids = rng.integers(0, cfg.vocab_size, (3, 40))
    cache = model.init_cache(3, 48)
    logits, cache = model.prefill(ids, cache, lens)
    logits = np.asarray(logits)
    step, cache = model.decode(ids[np.arange(3), np.minimum(lens, 39)], cache)
    step = np.asarray(step)
    for b, n in enumerate(lens):
        row = ids[b: b + 1, : n + 1].copy()
        row[0, n] = ids[b, min(n, 39)]
        ref = O.hf_logits(hf, row)[0]
        assert rel(logits[b, :n], ref[:n]) <= 1e-4
        assert rel(step[b], ref[n]) <= 1e-4
    # other rows' contents never leak into a row
    ids2 = ids.copy()
    ids2[1:] = rng.integers(0, cfg.vocab_size, ids2[1:].shape)
    logits2, _ = model.prefill(ids2, model.init_cache(3, 48), np.array([37, 40, 3]))
    np.testing.assert_array_equal(np.asarray(logits2)[0, :37], logits[0, :37])


@pytest.mark.core_params(loaded=["sliding-csa-hca"])
def test_decode_loop_compiles_once(loaded):
    cfg, _, model = loaded
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 10))
    cache = model.init_cache(2, 40)
    _, cache = model.prefill(ids, cache)
    _, cache = model.decode(ids[:, 0], cache)
    compiled = model_lib._jitted_chunk_impl._cache_size()
    for t in range(12):  # crosses window (8) and compression (4, 8) boundaries
        _, cache = model.decode(ids[:, t % 10], cache)
    assert model_lib._jitted_chunk_impl._cache_size() == compiled
    assert (np.asarray(cache.lengths) == 23).all()


@pytest.mark.core_params(loaded=["sliding-csa-hca"])
def test_cache_is_donated(loaded):
    cfg, _, model = loaded
    cache = model.init_cache(1, 16)
    old = cache.layers[0].window_kv
    _, new = model.prefill(np.array([[1, 2, 3]]), cache)
    if jax.default_backend() != "cpu" or old.is_deleted():
        assert old.is_deleted()
    assert new.layers[0].window_kv.shape == old.shape


@pytest.mark.core_params(loaded=["sliding-csa-hca"])
def test_cache_layout(loaded):
    cfg, _, model = loaded
    cache = model.init_cache(2, 64)
    for i, lc in enumerate(cache.layers):
        assert lc.window_kv.shape == (2, cfg.sliding_window, cfg.head_dim)  # a ring, never full length
        kind, r = cfg.layer_types[i], cfg.compress_ratios[i]
        if kind != "sliding":
            assert lc.compressed_kv.shape == (2, 64 // r, cfg.head_dim)
            assert lc.compressor.kv.dtype == jnp.float32
        if kind == "csa":
            assert lc.indexer_keys.shape == (2, 64 // r, cfg.index_head_dim)
            assert lc.compressor.prev_kv.shape == (2, r, cfg.head_dim)


@pytest.mark.core_params(loaded=["sliding-csa-hca"])
def test_bad_input_errors(loaded):
    cfg, _, model = loaded
    cache = model.init_cache(2, 16)
    with pytest.raises(ValueError, match="capacity"):
        model.prefill(np.ones((2, 17), np.int32), cache)
    with pytest.raises(ValueError, match="non-empty"):
        model.prefill(np.ones((2, 0), np.int32), cache)
    with pytest.raises(ValueError, match="vocabulary"):
        model.prefill(np.full((2, 3), cfg.vocab_size), cache)
    with pytest.raises(ValueError, match="vocabulary"):
        model(np.array([[-1, 2]]))
    with pytest.raises(ValueError, match="batch"):
        model.prefill(np.ones((3, 4), np.int32), cache)
    with pytest.raises(ValueError, match="never prefilled"):
        model.decode(np.array([1, 2]), cache)
    with pytest.raises(ValueError, match="lengths"):
        model.prefill(np.ones((2, 4), np.int32), cache, lengths=[5, 1])
    _, cache = model.prefill(np.ones((2, 16), np.int32), cache)
    with pytest.raises(ValueError, match="capacity"):
        model.decode(np.array([1, 2]), cache)
