"""dsv4_jax.inspect_attention: the traced attention inputs are the model's own (same logits and cache as prefill),
the probabilities are the op's softmax split by source, and what each query sees follows the layer types' rules.

The embedded checkpoint (window 8, CSA ratio 4 with top-4 picks, HCA ratio 8), fresh random prompts.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiers import full_tier

from pallas_kernels.sparse_attention.fp8_layout import take_rows

_SEED = itertools.count(4100)


@pytest.fixture(scope="module")
def model():
    from dsv4_jax.assets import embedded_checkpoint_path
    from dsv4_jax.checkpoint import load_pretrained

    return load_pretrained(embedded_checkpoint_path(), progress=False)


def _prompt(model, B, S):
    return np.random.default_rng(next(_SEED)).integers(0, model.config.vocab_size, (B, S))


def _rows(pool, idx):
    return take_rows(pool, jnp.maximum(idx, 0), jnp.float32)


def test_trace_is_the_prefill(model):
    """Two chunks (the second continues the first's cache, ragged lengths): the traced logits and cache equal
    prefill's; the probabilities sum to 1 and rebuild the op's output; the windows, HCA lists and CSA picks follow
    the rules of each layer type."""
    from dsv4_jax.inspect_attention import trace_attention

    c = model.config
    ids = _prompt(model, 2, 40)
    lengths = np.array([40, 27])
    cache = model.init_cache(2, 96)
    want_logits, want_cache = model.prefill(ids, model.init_cache(2, 96), lengths)
    logits, traces, cache = trace_attention(model, ids, cache, lengths)
    np.testing.assert_array_equal(np.asarray(logits)[0], np.asarray(want_logits)[0])
    np.testing.assert_array_equal(np.asarray(logits)[1, :27], np.asarray(want_logits)[1, :27])
    np.testing.assert_array_equal(np.asarray(cache.lengths), np.asarray(want_cache.lengths))
    # the second chunk has the first's shapes (one traced program for both): rows continue at 40 and 27
    _, traces2, cache2 = trace_attention(model, _prompt(model, 2, 40), cache, np.array([9, 33]))
    np.testing.assert_array_equal(np.asarray(cache2.lengths), [49, 60])
    assert [t.kind for t in traces] == list(c.layer_types)

    for t in traces + traces2:
        pw, pc, ps = t.probs()
        total = pw.sum(-1) + (0 if pc is None else pc.sum(-1)) + ps
        np.testing.assert_allclose(np.asarray(total), 1.0, atol=1e-5)
        o = jnp.einsum("bshk,bskd->bshd", pw, _rows(t.window_pool, t.window_idx))
        if pc is not None:
            o = o + jnp.einsum("bshk,bskd->bshd", pc, _rows(t.compressed_pool, t.compressed_idx))
        np.testing.assert_allclose(np.asarray(o), np.asarray(t.output()), atol=1e-5, rtol=1e-5)

        pos = np.asarray(t.positions)
        wp = np.asarray(t.window_positions())
        assert (wp[..., -1] == pos).all() and (wp <= pos[..., None]).all()
        np.testing.assert_array_equal((wp >= 0).sum(-1), np.minimum(pos + 1, c.sliding_window))
        np.testing.assert_array_equal(np.asarray(pw)[np.broadcast_to((wp < 0)[:, :, None, :], pw.shape)], 0.0)
        if t.kind == "sliding":
            assert t.compressed_entries() is None and pc is None
            continue
        ent = np.asarray(t.compressed_entries())
        complete = (pos + 1) // t.ratio
        if t.kind == "hca":   # every complete entry, in order
            want = np.where(np.arange(ent.shape[-1]) < complete[..., None], np.arange(ent.shape[-1]), -1)
            np.testing.assert_array_equal(ent, want)
        else:                 # the indexer's top-k of its scores, only complete entries
            np.testing.assert_array_equal(ent, np.asarray(t.picks))
            scores = np.asarray(t.indexer_scores())
            assert np.isneginf(scores[np.arange(scores.shape[-1]) >= complete[..., None]]).all()
            for b, s in itertools.product(range(ent.shape[0]), range(ent.shape[1])):
                picked = ent[b, s][ent[b, s] >= 0]
                assert len(picked) == min(complete[b, s], c.index_topk)
                if len(picked):   # no unpicked visible entry scores above the lowest pick
                    rest = np.delete(scores[b, s, :complete[b, s]], picked)
                    assert rest.size == 0 or rest.max() <= scores[b, s, picked].min()
        assert (ent < complete[..., None]).all()
        lo, hi = t.entry_span(2)
        assert hi == 3 * t.ratio - 1 and lo == (t.ratio if t.kind == "csa" else 2 * t.ratio)


@full_tier   # the default tier checks a kernel on traced lists in notebooks/02_attention_anatomy.ipynb
def test_trace_kernel_and_quantized_cache(model):
    """A kernel checked on a real layer's lists (the Pallas kernel, interpreted on CPU) and a trace over a quantized
    cache (bf16 KV rows, fp4 indexer keys; the FP8 KV layout needs head_dim 512): the traced pools are the stored
    rows, the indexer scores those of the stored keys, and the probabilities still sum to 1."""
    from dsv4_jax.inspect_attention import trace_attention

    ids = _prompt(model, 1, 24)
    _, traces, _ = trace_attention(model, ids)
    csa = next(t for t in traces if t.kind == "csa")
    np.testing.assert_allclose(np.asarray(csa.output(impl="pallas")), np.asarray(csa.output()), atol=2e-5,
                               rtol=2e-5)
    _, traces, _ = trace_attention(model, ids, model.init_cache(1, 24, kv_dtype="bf16", indexer_dtype="fp4"))
    assert traces[0].window_pool.dtype == jnp.bfloat16
    for t in traces:
        pw, pc, ps = t.probs()
        total = pw.sum(-1) + (0 if pc is None else pc.sum(-1)) + ps
        np.testing.assert_allclose(np.asarray(total), 1.0, atol=1e-5)
        if t.kind == "csa":
            scores = np.asarray(t.indexer_scores())
            picked = np.asarray(t.picks)[0, -1]
            assert (picked >= 0).all() and np.isfinite(scores[0, -1, picked]).all()


def test_trace_errors(model):
    from dsv4_jax.inspect_attention import trace_attention

    ids = _prompt(model, 1, 12)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        trace_attention(model, ids + model.config.vocab_size)
    with pytest.raises(ValueError, match="lengths must be"):
        trace_attention(model, ids, lengths=[13])
    with pytest.raises(ValueError, match="cache capacity"):
        trace_attention(model, ids, model.init_cache(1, 8))
    with pytest.raises(ValueError, match="does not match the cache's batch"):
        trace_attention(model, ids, model.init_cache(2, 16))
    # the shapes of test_trace_is_the_prefill's chunks: its compiled program, not a new one
    _, traces, _ = trace_attention(model, _prompt(model, 2, 40), model.init_cache(2, 96))
    sliding = next(t for t in traces if t.kind == "sliding")
    hca = next(t for t in traces if t.kind == "hca")
    with pytest.raises(ValueError, match="only CSA layers have an indexer"):
        hca.indexer_scores()
    with pytest.raises(ValueError, match="no compressed entries"):
        sliding.entry_span(0)
