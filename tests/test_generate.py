"""dsv4_jax.generate: greedy parity with transformers' `generate`, ragged batches, eos, sampling, errors, no recompiles.

One tiny random model (tests/oracle.py) loaded from transformers' save_pretrained layout; every test below reuses the
same two compiled programs (prefill + decode loop) for batch 4 — sampling knobs are runtime values.
"""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from dsv4_jax import engine
from dsv4_jax.config import tiny

# lengths 3, 11, 1, 6 (window 8, CSA ratio 4, HCA ratio 8): 20 new tokens cross every kind of boundary
PROMPTS = [[3, 7, 9], list(range(20, 31)), [5], [200, 100, 50, 25, 12, 6]]
N_NEW = 20


@pytest.fixture(scope="module")
def oracle_and_model(tmp_path_factory):
    import torch
    from oracle import make_hf_model, write_hf_layout

    from dsv4_jax.checkpoint import load_pretrained

    cfg = tiny()
    hf = make_hf_model(cfg, seed=0)
    d = tmp_path_factory.mktemp("hf_tiny")
    write_hf_layout(hf, d)
    model = load_pretrained(d, dtype=jnp.float32, attention_impl="reference", progress=False)
    return torch, hf, model


@pytest.fixture(scope="module")
def greedy(oracle_and_model):
    _, _, model = oracle_and_model
    tokens, stats = engine.generate_with_stats(model, PROMPTS, N_NEW)
    return tokens, stats


def test_greedy_matches_transformers_generate(oracle_and_model, greedy):
    torch, hf, _ = oracle_and_model
    ours, stats = greedy
    assert [len(t) for t in ours] == [N_NEW] * len(PROMPTS)
    assert stats.decode_steps == N_NEW - 1
    for p, o in zip(PROMPTS, ours):  # each row against transformers with batch 1
        out = hf.generate(torch.tensor([p]), max_new_tokens=N_NEW, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
        assert out[0, len(p):].tolist() == o, f"prompt {p}"


def test_eos_stops_rows_and_loop(oracle_and_model, greedy):
    _, _, model = oracle_and_model
    ours, _ = greedy
    eos = ours[1][4]  # row 1 hits it at step 4 (or earlier if it repeats)

    def cut(seq):
        return seq[: seq.index(eos) + 1] if eos in seq else seq

    got, stats = engine.generate_with_stats(model, PROMPTS, N_NEW, eos_id=eos)
    assert got == [cut(s) for s in ours]
    assert got[1][-1] == eos and len(got[1]) <= 5
    # a batch where every row stops early ends the loop early
    only = engine.generate_with_stats(model, [PROMPTS[1]] * 4, N_NEW, eos_id=eos)
    assert only[0] == [cut(ours[1])] * 4
    assert only[1].decode_steps == len(cut(ours[1])) - 1


def test_sampling_is_deterministic_per_seed(oracle_and_model, greedy):
    _, _, model = oracle_and_model
    kw = dict(temperature=1.0, top_k=50, top_p=0.95)
    a = engine.generate(model, PROMPTS, N_NEW, seed=1, **kw)
    b = engine.generate(model, PROMPTS, N_NEW, seed=1, **kw)
    c = engine.generate(model, PROMPTS, N_NEW, seed=2, **kw)
    assert a == b
    assert a != c
    assert all(0 <= t < 256 for row in a for t in row)
    # degenerate filters reduce to greedy
    ours, _ = greedy
    assert engine.generate(model, PROMPTS, N_NEW, temperature=0.7, top_k=1, seed=3) == ours
    assert engine.generate(model, PROMPTS, N_NEW, temperature=1.0, top_p=1e-6, seed=4) == ours


def test_no_recompilation(oracle_and_model, greedy):
    _, _, model = oracle_and_model
    before = engine.compile_count()
    # same buckets (prompts <= 16 tokens, <= 64 new tokens, cache capacity 64, batch 4): other prompt lengths, step
    # counts and sampling knobs reuse both programs
    engine.generate(model, [[1], [2, 3], [4, 5, 6], [7] * 12], 9)
    engine.generate(model, PROMPTS, 3, temperature=0.5, top_k=5, top_p=0.5, seed=9)
    engine.generate(model, [[9]] * 4, 40)
    assert engine.compile_count() == before


def test_max_new_tokens_zero_and_prefix_consistency(oracle_and_model, greedy):
    _, _, model = oracle_and_model
    ours, _ = greedy
    assert engine.generate(model, PROMPTS, 0) == [[], [], [], []]
    assert engine.generate(model, PROMPTS, 5) == [t[:5] for t in ours]


@pytest.mark.parametrize("kwargs,match", [
    (dict(prompts=[]), "non-empty list"),
    (dict(prompts=[[1, 2], []]), "prompt 1 is empty"),
    (dict(prompts=[1, 2, 3]), "list of token-id lists"),
    (dict(prompts=[[1, 256]]), r"outside \[0, vocab_size=256\)"),
    (dict(prompts=[[-1]]), "outside"),
    (dict(prompts=[[1.5]]), "non-integer"),
    (dict(max_new_tokens=-1), "max_new_tokens must be >= 0"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=0), "top_k"),
    (dict(max_len=10, max_new_tokens=8), "exceeds max_len=10"),
    (dict(max_new_tokens=5000), "max_position_embeddings"),
    (dict(eos_id=256), "eos_id"),
    (dict(seed=1.5), "seed"),
])
def test_errors(oracle_and_model, kwargs, match):
    _, _, model = oracle_and_model
    args = dict(prompts=[[1, 2, 3]], max_new_tokens=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        engine.generate(model, **args)


# ------------------------------------------------------------------------------ sampling unit tests (no model)
def _sample(logits, n, **kw):
    logits = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (n, len(logits)))
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.PRNGKey(0), i))(jnp.arange(n))
    return np.asarray(engine.sample_logits(logits, keys, jnp.float32(kw.get("t", 1.0)),
                                           jnp.int32(kw.get("k", len(logits))), jnp.float32(kw.get("p", 1.0))))


def test_sample_logits_filters():
    logits = np.log(np.array([0.05, 0.4, 0.3, 0.15, 0.1]))
    assert set(_sample(logits, 2, t=0.0)) == {1}
    s = _sample(logits, 4000)
    freq = np.bincount(s, minlength=5) / len(s)
    np.testing.assert_allclose(freq, [0.05, 0.4, 0.3, 0.15, 0.1], atol=0.03)
    assert set(_sample(logits, 2000, k=2)) == {1, 2}
    assert set(_sample(logits, 2000, p=0.6)) == {1, 2}  # 0.4 < 0.6, 0.4 + 0.3 reaches it
    assert set(_sample(logits, 2000, p=0.4)) == {1}
    assert set(_sample(logits, 2000, k=3, p=0.99)) == {1, 2, 3}
    low_t = _sample(logits, 500, t=0.05)
    assert (low_t == 1).mean() > 0.95
