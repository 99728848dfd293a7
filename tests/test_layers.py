"""Layer-level parity with the oracle's submodules: compressor entries (main and indexer), indexer top-k picks,
mHC weights. Fresh random weights and inputs; float32 CPU."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import dsv4_jax
from dsv4_jax.cache import CompressorState
from dsv4_jax.config import tiny
from dsv4_jax.layers.hyper import hc_collapse, hc_weights

import oracle as O

CFG = tiny(ratios=[0, 4, 8])
B, S = 2, 41


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    hf = O.make_hf_model(CFG, seed=11)
    path = tmp_path_factory.mktemp("ckpt")
    O.write_hf_layout(hf, path)
    model = dsv4_jax.load_pretrained(str(path), attention_impl="reference", progress=False)
    ids = np.random.default_rng(3).integers(0, CFG.vocab_size, (B, S))
    return hf, model, ids


def test_compressed_entries_match_oracle_cache(pair):
    hf, model, ids = pair
    with torch.no_grad():
        out = hf(torch.from_numpy(ids), use_cache=True)
    hf_cache = out.past_key_values if getattr(out, "past_key_values", None) is not None else out.cache
    cache = model.init_cache(B, S)
    _, cache = model.prefill(ids, cache)
    for i, (kind, ratio) in enumerate(zip(CFG.layer_types, CFG.compress_ratios)):
        if kind == "sliding":
            continue
        names = [("compressor", cache.layers[i].compressed_kv)]
        if kind == "csa":
            names.append(("indexer", cache.layers[i].indexer_keys))
        for name, ours in names:
            ref = hf_cache.layers[i].compressed_kv[name].numpy()
            assert ref.shape[1] == S // ratio
            got = np.asarray(ours)[:, : S // ratio]
            np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max(), err_msg=f"layer {i} {name}")


def test_indexer_picks_match_oracle(pair):
    hf, model, ids = pair
    layer = CFG.layer_types.index("csa")
    seen = {}
    attn_hf = hf.model.layers[layer].self_attn

    def grab_input(module, args, kwargs):
        seen["x"] = args[0] if args else kwargs["hidden_states"]

    def grab_picks(module, args, output):
        seen["picks"] = output

    h1 = attn_hf.register_forward_pre_hook(grab_input, with_kwargs=True)
    h2 = attn_hf.compressor.indexer.register_forward_hook(grab_picks)
    try:
        with torch.no_grad():
            hf(torch.from_numpy(ids), use_cache=False)
    finally:
        h1.remove(), h2.remove()
    x = jnp.asarray(seen["x"].numpy())
    ref = np.sort(seen["picks"].numpy(), axis=-1)

    attn = model.layers[layer].attn
    positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    zeros = jnp.zeros((B,), jnp.int32)
    cap = S // attn.ratio
    state = CompressorState.empty(B, attn.ratio, CFG.index_head_dim, True)
    keys, _ = attn.indexer.compressor(x, positions, zeros, jnp.full((B,), S, jnp.int32), state,
                                      jnp.zeros((B, cap, CFG.index_head_dim), jnp.float32))
    qr = attn.q_norm(attn.wq_a(x))
    picks = np.sort(np.asarray(attn.indexer.select(x, qr, positions, keys)), axis=-1)
    assert picks.shape == ref.shape
    assert CFG.index_topk < cap  # the top-k really selects
    np.testing.assert_array_equal(picks, ref)


@pytest.mark.parametrize("site", ["attn", "ffn"])
def test_mhc_weights_match_oracle(pair, site):
    hf, model, _ = pair
    rng = np.random.default_rng(5)
    streams = rng.standard_normal((B, 7, CFG.hc_mult, CFG.hidden_size)).astype(np.float32)
    for i, block in enumerate(model.layers):
        with torch.no_grad():
            post_r, comb_r, coll_r = getattr(hf.model.layers[i], f"{site}_hc")(torch.from_numpy(streams))
        pre, post, comb = hc_weights(jnp.asarray(streams), getattr(block, f"hc_{site}_fn")[...],
                                     getattr(block, f"hc_{site}_base")[...], getattr(block, f"hc_{site}_scale")[...],
                                     hc=CFG.hc_mult, iters=CFG.hc_sinkhorn_iters, eps=CFG.hc_eps,
                                     norm_eps=CFG.rms_norm_eps)
        np.testing.assert_allclose(np.asarray(post), post_r.numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(comb), comb_r.numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(hc_collapse(jnp.asarray(streams), pre)), coll_r.numpy(),
                                   rtol=1e-5, atol=1e-5)
