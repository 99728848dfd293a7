"""Batched generation: one prefill of right-padded prompts, then an on-device token loop.

`generate(model, prompts, max_new_tokens, ...)`:

1. validates the request (clear `ValueError`s), right-pads the prompts to a static length bucket and allocates a cache
   of static capacity `max_len` (also bucketed) with ``model.init_cache``;
2. runs ONE jitted program for the prefill (``forward_chunk`` of the right-padded prompts, which is what
   `model.prefill` runs) that also samples every row's first new token from that row's last valid prompt position;
3. runs ONE jitted program holding a `lax.while_loop` around the pure step
   ``forward_chunk(nnx.merge(graphdef, state), tokens[:, None], cache, ones)`` + sampling; the loop stops when every
   row has emitted `eos_id` or `max_new_tokens` tokens were produced. Nothing returns to Python between steps.

Both programs are compiled ahead of time (``jit(...).lower(...).compile()``) and kept in a small cache keyed by the
model's graph definition and every static shape, so repeated calls with the same buckets never recompile and the
step count is a runtime value (no recompilation per step or per `max_new_tokens` within a bucket).
`generate_with_stats` returns the same tokens plus honest timings (compile, prefill, decode loop — each measured
from dispatch to ``block_until_ready``).

Sampling (`sample_logits`): greedy (argmax) when temperature == 0; otherwise logits / temperature, then optional top-k
(keep the k largest) and top-p (keep the smallest prefix of the sorted distribution whose mass reaches p, always at
least one token), then a categorical draw with a per-row, per-step key ``fold_in(fold_in(PRNGKey(seed), row), step)`` —
so a row's samples depend on the seed and its own logits only, not on which other prompts share the batch.
Temperature, top-k and top-p are runtime values (greedy vs sampling is a `lax.cond`), so every setting shares one
compiled program per shape bucket.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .cache import place_cache

PAD_ID = 0  # token fed for padding positions (masked out by `lengths`)
_NO_TOKEN = -1  # marks "no token" in the on-device output buffer


# ---------------------------------------------------------------------------------------------------- sampling
def sample_logits(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_k: jax.Array,
                  top_p: jax.Array) -> jax.Array:
    """logits [B, V] -> tokens [B] int32; keys: [B] PRNG keys (one per row, already folded with the step).

    All knobs are runtime values (one compiled program serves every setting): temperature == 0 -> argmax;
    top_k >= V and top_p >= 1 disable those filters. The sort only runs when sampling (inside `lax.cond`).
    """
    logits = logits.astype(jnp.float32)
    vocab = logits.shape[-1]

    def greedy(_):
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sample(_):
        scaled = logits / jnp.maximum(temperature, 1e-6)
        sorted_desc = -jnp.sort(-scaled, axis=-1)  # [B, V]
        k = jnp.clip(top_k, 1, vocab)
        rank = jnp.arange(vocab)
        sorted_desc = jnp.where(rank < k, sorted_desc, -jnp.inf)  # top-k on the sorted view
        probs = jax.nn.softmax(sorted_desc, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        keep = (rank < k) & ((mass_before < top_p) | (top_p >= 1.0) | (rank == 0))
        # threshold = smallest kept logit; every logit >= it survives (ties with the threshold are kept)
        thresh = jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1, keepdims=True)
        filtered = jnp.where(scaled < thresh, -jnp.inf, scaled)
        return jax.vmap(lambda kk, l: jax.random.categorical(kk, l))(keys, filtered).astype(jnp.int32)

    return jax.lax.cond(temperature == 0, greedy, sample, None)


def _row_keys(base_key: jax.Array, batch: int, step: jax.Array) -> jax.Array:
    rows = jax.vmap(lambda b: jax.random.fold_in(base_key, b))(jnp.arange(batch, dtype=jnp.uint32))
    return jax.vmap(lambda k: jax.random.fold_in(k, step))(rows)


# ---------------------------------------------------------------------------------------------------- programs
def _last_logits(logits: jax.Array, lengths: jax.Array) -> jax.Array:
    """Prefill logits [B,S,V] (or already [B,V]) -> logits at each row's last valid position [B,V]."""
    if logits.ndim == 2:
        return logits
    idx = jnp.clip(lengths - 1, 0, logits.shape[1] - 1)
    return jnp.take_along_axis(logits, idx[:, None, None], axis=1)[:, 0]


def _prefill_program(graphdef, state, cache, ids, lengths, key, temperature, top_k, top_p):
    from dsv4_jax.model import forward_chunk

    # `model.prefill` is this same pure function behind Python-side checks (done by `_validate` here).
    logits, cache = forward_chunk(nnx.merge(graphdef, state), ids, cache, lengths)
    last = _last_logits(logits, lengths)
    first = sample_logits(last, _row_keys(key, ids.shape[0], jnp.uint32(0)), temperature, top_k, top_p)
    return first, cache


def _decode_program(graphdef, state, cache, first, n_new, eos_id, key, temperature, top_k, top_p, *,
                    buf_len: int):
    """Token loop. first [B]: tokens sampled from prefill -> (out [B, buf_len] (-1 = none), counts [B], steps, cache)."""
    from dsv4_jax.model import forward_chunk

    batch = first.shape[0]
    out = jnp.full((batch, buf_len), _NO_TOKEN, jnp.int32).at[:, 0].set(first)
    done = (first == eos_id) | (n_new <= 1)
    counts = jnp.ones((batch,), jnp.int32)
    ones = jnp.ones((batch,), jnp.int32)

    def cond(carry):
        i, _, _, done, _, _ = carry
        return (i < n_new) & ~jnp.all(done)

    def body(carry):
        i, tok, out, done, counts, cache = carry
        model = nnx.merge(graphdef, state)
        logits, cache = forward_chunk(model, tok[:, None], cache, ones)
        last = logits[:, -1] if logits.ndim == 3 else logits
        nxt = sample_logits(last, _row_keys(key, batch, i.astype(jnp.uint32)), temperature, top_k, top_p)
        nxt = jnp.where(done, _NO_TOKEN, nxt)
        out = jax.lax.dynamic_update_slice(out, nxt[:, None], (jnp.int32(0), i))
        counts = counts + (~done).astype(jnp.int32)
        done = done | (nxt == eos_id)
        feed = jnp.where(done, PAD_ID, nxt)
        return i + 1, feed, out, done, counts, cache

    init = (jnp.int32(1), jnp.where(done, PAD_ID, first), out, done, counts, cache)
    steps, _, out, _, counts, cache = jax.lax.while_loop(cond, body, init)
    return out, counts, steps - 1, cache  # the cache is returned so its donated input buffers are reused in place


_COMPILED: dict[Any, Any] = {}
_MAX_COMPILED = 32
_N_COMPILES = [0]


def _abstract_key(tree) -> tuple:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef, tuple((tuple(l.shape), str(l.dtype)) for l in leaves)


def _compiled(name: str, fn, static: dict, args: tuple, donate: tuple = (), out_shardings=None):
    """AOT-compile `fn(*args, **static)` once per (name, static, graphdef, abstract args, output formats).

    args[0] is the (hashable, static) nnx GraphDef. The inputs' device layouts are the arguments' own (a placed
    cache's, `cache.place_cache`); out_shardings: None, or a prefix pytree of the outputs with `Format`s where an
    output must come back in a declared layout (the returned cache) and None elsewhere.
    Returns (executable taking args[1:], compile seconds or 0.0).
    """
    out_key = None if out_shardings is None else tuple(jax.tree_util.tree_leaves(out_shardings))
    key = (name, tuple(sorted(static.items())), args[0], _abstract_key(args[1:]), out_key)
    exe = _COMPILED.get(key)
    if exe is not None:
        return exe, 0.0
    t0 = time.perf_counter()
    kw = {} if out_shardings is None else {"out_shardings": out_shardings}
    jitted = jax.jit(fn, static_argnums=(0,), static_argnames=tuple(static), donate_argnums=donate, **kw)
    exe = jitted.lower(*args, **static).compile()
    dt = time.perf_counter() - t0
    if len(_COMPILED) >= _MAX_COMPILED:
        _COMPILED.pop(next(iter(_COMPILED)))
    _COMPILED[key] = exe
    _N_COMPILES[0] += 1
    return exe, dt


def compile_count() -> int:
    """Number of programs compiled so far by this module (tests use it to check that nothing recompiles)."""
    return _N_COMPILES[0]


# ---------------------------------------------------------------------------------------------------- public API
def _bucket(n: int, minimum: int = 16, granule: int = 4096) -> int:
    """Round up to a power of two (>= minimum) up to `granule`, then to a multiple of `granule`, so nearby request
    sizes share compiled programs without doubling long caches."""
    if n > granule:
        return -(-n // granule) * granule
    return max(minimum, 1 << max(0, math.ceil(math.log2(max(1, n)))))


def _model_config(model):
    cfg = getattr(model, "config", None)
    if cfg is None:
        raise ValueError("model has no `config` attribute; pass a dsv4_jax DeepseekV4ForCausalLM")
    return cfg


def _validate(model, prompts, max_new_tokens, temperature, top_k, top_p, max_len, eos_id=None, seed=0):
    cfg = _model_config(model)
    if isinstance(prompts, (np.ndarray, jax.Array)):
        prompts = np.asarray(prompts).tolist()
    if not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    if all(isinstance(t, (int, np.integer)) for t in prompts):
        raise ValueError("prompts must be a list of token-id lists (got a flat list of ints; wrap it: [prompt])")
    clean = []
    for i, p in enumerate(prompts):
        p = np.asarray(p).tolist() if isinstance(p, (np.ndarray, jax.Array)) else list(p)
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        for t in p:
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
                raise ValueError(f"prompt {i} contains a non-integer token {t!r}")
            if not 0 <= int(t) < cfg.vocab_size:
                raise ValueError(f"prompt {i} contains token id {int(t)} outside [0, vocab_size={cfg.vocab_size})")
        clean.append([int(t) for t in p])
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)):
        raise ValueError(f"max_new_tokens must be an int, got {max_new_tokens!r}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 1):
        raise ValueError(f"top_k must be None or an int >= 1, got {top_k!r}")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be None or in (0, 1], got {top_p!r}")
    if eos_id is not None and (isinstance(eos_id, bool) or not isinstance(eos_id, (int, np.integer))
                               or not 0 <= eos_id < cfg.vocab_size):
        raise ValueError(f"eos_id must be None or a token id in [0, vocab_size={cfg.vocab_size}), got {eos_id!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"seed must be an int, got {seed!r}")
    longest = max(len(p) for p in clean)
    need = longest + max_new_tokens
    limit = cfg.max_position_embeddings
    if max_len is not None:
        if isinstance(max_len, bool) or not isinstance(max_len, (int, np.integer)) or max_len < 1:
            raise ValueError(f"max_len must be a positive int, got {max_len!r}")
        if need > max_len:
            raise ValueError(f"longest prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) = {need} exceeds "
                             f"max_len={max_len} (the cache capacity)")
    if need > limit:
        raise ValueError(f"longest prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) = {need} exceeds "
                         f"the model's max_position_embeddings={limit}")
    return cfg, clean


@dataclasses.dataclass
class GenerationStats:
    """What `generate_with_stats` measured. Times in seconds, each from dispatch to block_until_ready."""

    batch_size: int
    prompt_lengths: list[int]
    padded_prompt_len: int
    max_len: int
    new_tokens: list[int]
    decode_steps: int  # forward steps run by the on-device loop (= tokens after the first, per row)
    compile_s: float  # AOT lowering + compilation of the programs not already cached (0 when cached)
    prefill_s: float  # the prefill program (all prompts, incl. first-token sampling)
    decode_s: float  # the whole on-device loop (all steps, incl. sampling), one dispatch
    cache_bytes: int  # bytes of the cache pytree actually allocated

    @property
    def decode_tokens_per_s(self) -> float:
        """Batch tokens per second of the decode loop (batch_size * steps / decode_s)."""
        return self.batch_size * self.decode_steps / self.decode_s if self.decode_s > 0 else float("nan")

    @property
    def step_ms(self) -> float:
        return 1e3 * self.decode_s / self.decode_steps if self.decode_steps else float("nan")

    @property
    def prefill_tokens_per_s(self) -> float:
        return sum(self.prompt_lengths) / self.prefill_s if self.prefill_s > 0 else float("nan")


def generate_with_stats(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 0.0,
                        top_k: int | None = None, top_p: float | None = None, seed: int = 0,
                        eos_id: int | None = None, max_len: int | None = None, *, kv_dtype: str | None = None,
                        indexer_dtype: str | None = None, indexer_rotate: bool = False):
    """Like :func:`generate` but returns ``(tokens, GenerationStats)``."""
    cfg, prompts = _validate(model, prompts, max_new_tokens, temperature, top_k, top_p, max_len, eos_id, seed)
    batch = len(prompts)
    lengths = [len(p) for p in prompts]
    if max_new_tokens == 0:
        return [[] for _ in prompts], GenerationStats(batch, lengths, 0, 0, [0] * batch, 0, 0.0, 0.0, 0.0, 0)
    longest = max(lengths)
    s_pad = _bucket(longest, 16)
    if max_len is None:
        max_len = min(_bucket(s_pad + max_new_tokens, 64), cfg.max_position_embeddings)
        max_len = max(max_len, longest + max_new_tokens)
    s_pad = min(s_pad, max_len)
    buf_len = _bucket(max_new_tokens, 64)

    ids = np.full((batch, s_pad), PAD_ID, np.int32)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = p
    ids = jnp.asarray(ids)
    lens = jnp.asarray(lengths, jnp.int32)
    temp = jnp.float32(temperature)
    tk = jnp.int32(top_k if top_k is not None else cfg.vocab_size)
    tp = jnp.float32(top_p if top_p is not None else 1.0)
    key = jax.random.PRNGKey(seed)
    eos = jnp.int32(-2 if eos_id is None else eos_id)  # -2 never matches a sampled token

    graphdef, state = nnx.split(model)
    cache = (model.init_cache(batch, max_len) if kv_dtype is None and indexer_dtype is None and not indexer_rotate
             else model.init_cache(batch, max_len, kv_dtype=kv_dtype, indexer_dtype=indexer_dtype,
                                   indexer_rotate=indexer_rotate))
    cache_nbytes = sum(int(l.nbytes) for l in jax.tree_util.tree_leaves(cache))
    # the kernels' layouts for the cache's arrays where they differ from XLA's defaults (TPU), so no step relays out
    # the cache around a kernel call; both programs return it in them
    cache, formats = place_cache(cache)

    pre_args = (graphdef, state, cache, ids, lens, key, temp, tk, tp)
    pre_exe, c1 = _compiled("prefill", _prefill_program, {}, pre_args, donate=(2,),
                            out_shardings=None if formats is None else (None, formats))
    t0 = time.perf_counter()
    first, cache = pre_exe(*pre_args[1:])
    jax.block_until_ready((first, cache))
    prefill_s = time.perf_counter() - t0

    dec_args = (graphdef, state, cache, first, jnp.int32(max_new_tokens), eos, key, temp, tk, tp)
    dec_exe, c2 = _compiled("decode", _decode_program, {"buf_len": buf_len}, dec_args, donate=(2,),
                            out_shardings=None if formats is None else (None, None, None, formats))
    t0 = time.perf_counter()
    out, counts, steps, cache = dec_exe(*dec_args[1:])
    jax.block_until_ready((out, counts, steps))
    del cache
    decode_s = time.perf_counter() - t0

    out = np.asarray(out)
    counts = np.asarray(counts)
    result = [out[b, : counts[b]].tolist() for b in range(batch)]
    stats = GenerationStats(batch, lengths, s_pad, max_len, [len(r) for r in result], int(steps), c1 + c2,
                            prefill_s, decode_s, cache_nbytes)
    return result, stats


def generate(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, seed: int = 0, eos_id: int | None = None,
             max_len: int | None = None, *, kv_dtype: str | None = None, indexer_dtype: str | None = None,
             indexer_rotate: bool = False) -> list[list[int]]:
    """Generates up to `max_new_tokens` tokens for each prompt (lists of token ids, any lengths).

    Args:
      model: a dsv4_jax `DeepseekV4ForCausalLM` (e.g. from `load_pretrained`).
      prompts: list of prompts, each a non-empty list of token ids in [0, vocab_size).
      max_new_tokens: tokens to generate per prompt (>= 0).
      temperature: 0 = greedy (argmax); > 0 samples from softmax(logits / temperature).
      top_k, top_p: optional filters applied before sampling (ignored when greedy).
      seed: PRNG seed for sampling; the same seed gives the same tokens.
      eos_id: a row stops after emitting this token (it is included in the output).
      max_len: cache capacity in tokens (default: bucketed from the request); each prompt + max_new_tokens must fit.
      kv_dtype, indexer_dtype, indexer_rotate: cache storage formats, passed to ``model.init_cache`` (None = exact,
        rows in the model dtype; "bf16" | "fp8" KV rows; "bf16" | "fp8" | "fp4" indexer keys; spec §8.1).

    Returns:
      One list of new token ids per prompt (length <= max_new_tokens, ending with eos_id if it was hit).
    """
    return generate_with_stats(model, prompts, max_new_tokens, temperature, top_k, top_p, seed, eos_id, max_len,
                               kv_dtype=kv_dtype, indexer_dtype=indexer_dtype, indexer_rotate=indexer_rotate)[0]


__all__ = ["generate", "generate_with_stats", "GenerationStats", "sample_logits", "compile_count"]
