"""DeepSeek-V4 causal LM as Flax NNX modules, with one chunked forward for every call shape.

`forward_chunk(model, input_ids, cache, lengths)` is the whole model for one chunk of each sequence: the stateless
forward is one chunk from an empty cache, prefill is one or several chunks, decode is a chunk of one token. It is a
pure function of (params, inputs, cache) -> (logits, cache); the methods below jit it once per shape with the cache
donated.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_kernels.dispatch import resolve_impl
from pallas_kernels.indexer import PICKS
from pallas_kernels.sparse_attention import GPU_KERNELS

from .cache import CacheFormat, ModelCache, init_cache, place_cache
from .config import DeepseekV4Config
from .layers.attention import Attention
from .layers.common import Embedding, Linear, RMSNorm, normal, param
from .layers.hyper import hc_collapse, hc_expand, hc_head_collapse, hc_weights
from .layers.moe import MoE


class Block(nnx.Module):
    """One decoder layer: mHC pre-mix -> attn_norm -> attention -> mHC post-mix, then the same around the MoE."""

    def __init__(self, config: DeepseekV4Config, layer_idx: int, *, dtype, attention_impl: str, rngs: nnx.Rngs,
                 indexer_picks: str = "sorted", attention_kernel: str = "auto", expert_weights: str = "dequantized"):
        c = config
        n_mix, width = (2 + c.hc_mult) * c.hc_mult, c.hc_mult * c.hidden_size
        for site in ("attn", "ffn"):
            setattr(self, f"hc_{site}_fn", param(normal(rngs, (n_mix, width), width ** -0.5, jnp.float32),
                                                  (None, None)))
            setattr(self, f"hc_{site}_base", param(normal(rngs, (n_mix,), 0.5, jnp.float32), (None,)))
            setattr(self, f"hc_{site}_scale", param(1.0 + normal(rngs, (3,), 0.1, jnp.float32), (None,)))
        self.attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, rngs=rngs)
        self.attn = Attention(c, layer_idx, dtype=dtype, attention_impl=attention_impl, rngs=rngs,
                              indexer_picks=indexer_picks, attention_kernel=attention_kernel)
        self.ffn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, rngs=rngs)
        self.ffn = MoE(c, layer_idx, dtype=dtype, rngs=rngs, expert_weights=expert_weights)
        self._hc = (c.hc_mult, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps)  # static (hc, iters, eps, norm_eps)

    @property
    def _hc_kwargs(self):
        return dict(zip(("hc", "iters", "eps", "norm_eps"), self._hc))

    def __call__(self, streams, ids, positions, start, n_valid, layer_cache, fmt: CacheFormat = CacheFormat(),
                 trace: list | None = None):
        """streams [B, S, hc, D] -> (streams, layer_cache). trace: see `Attention.__call__`."""
        pre, post, comb = hc_weights(streams, self.hc_attn_fn[...], self.hc_attn_base[...], self.hc_attn_scale[...],
                                     **self._hc_kwargs)
        out, layer_cache = self.attn(self.attn_norm(hc_collapse(streams, pre)), positions, start, n_valid,
                                     layer_cache, fmt, trace=trace)
        streams = hc_expand(out, streams, post, comb)
        pre, post, comb = hc_weights(streams, self.hc_ffn_fn[...], self.hc_ffn_base[...], self.hc_ffn_scale[...],
                                     **self._hc_kwargs)
        out = self.ffn(self.ffn_norm(hc_collapse(streams, pre)), ids)
        return hc_expand(out, streams, post, comb), layer_cache


class DeepseekV4ForCausalLM(nnx.Module):
    """DeepSeek-V4 backbone + LM head. Parameter paths mirror the original checkpoint names (see checkpoint/).

    model(input_ids [B, S]) -> logits [B, S, vocab] float32 (stateless).
    model.init_cache(batch_size, max_len) -> ModelCache.
    model.prefill(input_ids [B, S], cache, lengths [B] | None) -> (logits [B, S, vocab], cache).
    model.decode(tokens [B], cache) -> (logits [B, vocab], cache).
    """

    def __init__(self, config: DeepseekV4Config, *, dtype=jnp.float32, attention_impl: str = "auto",
                 rngs: nnx.Rngs, indexer_picks: str = "auto", attention_kernel: str = "auto",
                 expert_weights: str = "dequantized"):
        """indexer_picks: "sorted" (the CSA indexer's picks best first, as the reference), "set" (ascending
        index: the GPU kernel path skips its last sort; the attention sums the same entries in another order) or
        "auto" (default: "set" where the indexer runs the GPU kernel -- model parity with the reference passes on
        the H200 in both modes, session 8 -- else "sorted", which the reference and TPU paths produce directly).
        attention_kernel: which GPU sparse-attention kernel (see pallas_kernels.sparse_attention): "auto"
        (default: the Mosaic GPU kernel for bf16 models with 64 or 128 heads and bf16 or FP8 caches, else Triton),
        "mosaic", "triton". Ignored off the GPU, except that "mosaic" is refused there.
        expert_weights: how the routed experts are held, "dequantized" (default: in `dtype`) or "fp4" (the
        checkpoint's FP4 bytes as they are, 3.8x less memory, read by `pallas_kernels.grouped_matmul.fp4`; the same
        products; `layers.moe.EXPERT_WEIGHTS`)."""
        c = config
        if indexer_picks == "auto":
            indexer_picks = "set" if resolve_impl(attention_impl, "indexer") == "gpu" else "sorted"
        if indexer_picks not in PICKS:  # checked here too: at construction, not at the first CSA call
            raise ValueError(f"indexer_picks must be 'auto' or one of {PICKS}, got {indexer_picks!r}")
        self.indexer_picks = indexer_picks
        if attention_kernel not in GPU_KERNELS:
            raise ValueError(f"attention_kernel must be one of {GPU_KERNELS}, got {attention_kernel!r}")
        if attention_kernel == "mosaic" and resolve_impl(attention_impl, "sparse_attention") != "gpu":
            raise ValueError("attention_kernel='mosaic' needs attention_impl resolving to the GPU kernels")
        self.config, self.dtype, self.attention_impl = c, jnp.dtype(dtype), attention_impl
        self.embed = Embedding(c.vocab_size, c.hidden_size, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([Block(c, i, dtype=dtype, attention_impl=attention_impl, rngs=rngs,
                                      indexer_picks=indexer_picks, attention_kernel=attention_kernel,
                                      expert_weights=expert_weights)
                                for i in range(c.num_hidden_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, rngs=rngs)
        width = c.hc_mult * c.hidden_size
        self.hc_head_fn = param(normal(rngs, (c.hc_mult, width), width ** -0.5, jnp.float32), (None, None))
        self.hc_head_base = param(normal(rngs, (c.hc_mult,), 0.5, jnp.float32), (None,))
        self.hc_head_scale = param(1.0 + normal(rngs, (1,), 0.1, jnp.float32), (None,))
        self.head = Linear(c.hidden_size, c.vocab_size, dtype=dtype, rngs=rngs, axes=("vocab", "embed"))

    # ----------------------------------------------------------------- public API
    def init_cache(self, batch_size: int, max_len: int, kv_dtype: str | None = None,
                   indexer_dtype: str | None = None, indexer_rotate: bool = False) -> ModelCache:
        """Empty cache for `batch_size` sequences of up to `max_len` tokens.

        kv_dtype: None (exact: model dtype) | "bf16" | "fp8" for window and compressed KV rows;
        indexer_dtype: None | "bf16" | "fp8" | "fp4" for indexer keys; indexer_rotate: Hadamard on indexer q/k.
        """
        fmt = CacheFormat(kv_dtype, indexer_dtype, indexer_rotate)
        return init_cache(self.config, batch_size, max_len, self.dtype, fmt)

    def __call__(self, input_ids) -> jax.Array:
        ids = self._check_ids(input_ids)
        B, S = ids.shape
        cache = self.init_cache(B, S)
        logits, _ = _jitted_chunk(*nnx.split(self), ids, cache, jnp.full((B,), S, jnp.int32))
        return logits

    def prefill(self, input_ids, cache: ModelCache, lengths=None):
        """Feeds a right-padded chunk [B, S] (row b valid for lengths[b] tokens) after what `cache` holds."""
        ids, lengths = self._check_chunk(input_ids, cache, lengths)
        return _jitted_chunk(*nnx.split(self), ids, cache, lengths)

    def decode(self, tokens, cache: ModelCache):
        """One token per sequence: tokens [B] -> (logits [B, vocab], cache)."""
        tokens = np.asarray(tokens)
        if tokens.ndim != 1:
            raise ValueError(f"decode takes tokens of shape [batch], got {tokens.shape}")
        B = tokens.shape[0]
        self._check_batch(cache, B)
        if (np.asarray(cache.lengths) == 0).any():
            raise ValueError("decode on a cache that was never prefilled (some rows have length 0); call prefill first")
        ones = np.ones((B,), np.int32)
        self._check_vocab(tokens[:, None], ones)
        self._check_capacity(cache, ones)
        logits, cache = _jitted_chunk(*nnx.split(self), jnp.asarray(tokens[:, None], jnp.int32), cache,
                                      jnp.asarray(ones))
        return logits[:, 0], cache

    # ----------------------------------------------------------------- checks
    def _check_chunk(self, input_ids, cache: ModelCache, lengths):
        """prefill's argument checks -> (ids [B, S] int32, lengths [B] int32): ids in the vocabulary, lengths in
        [0, S] (None: S), the cache's batch and capacity."""
        ids = self._check_ids(input_ids)
        B, S = ids.shape
        self._check_batch(cache, B)
        lengths = np.full((B,), S, np.int32) if lengths is None else np.asarray(lengths, np.int32)
        if lengths.shape != (B,) or (lengths < 0).any() or (lengths > S).any():
            raise ValueError(f"lengths must be [batch={B}] ints in [0, {S}], got {lengths.tolist()}")
        self._check_vocab(np.asarray(input_ids), lengths)
        self._check_capacity(cache, lengths)
        return ids, jnp.asarray(lengths)

    def _check_ids(self, input_ids):
        ids = np.asarray(input_ids)
        if ids.ndim != 2 or ids.shape[1] == 0 or ids.shape[0] == 0:
            raise ValueError(f"input_ids must be a non-empty int array [batch, seq], got shape {ids.shape}")
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"input_ids must be integers, got {ids.dtype}")
        self._check_vocab(ids, np.full((ids.shape[0],), ids.shape[1]))
        return jnp.asarray(ids, jnp.int32)

    def _check_vocab(self, ids, lengths):
        valid = np.arange(ids.shape[1])[None, :] < np.asarray(lengths)[:, None]
        bad = valid & ((ids < 0) | (ids >= self.config.vocab_size))
        if bad.any():
            raise ValueError(f"token ids outside the vocabulary [0, {self.config.vocab_size}): "
                             f"{sorted(set(np.asarray(ids)[bad].tolist()))[:10]}")

    @staticmethod
    def _check_batch(cache: ModelCache, B: int):
        if cache.batch_size != B:
            raise ValueError(f"batch of {B} sequences does not match the cache's batch of {cache.batch_size}")

    @staticmethod
    def _check_capacity(cache: ModelCache, lengths):
        total = np.asarray(cache.lengths) + np.asarray(lengths)
        if (total > cache.max_len).any():
            row = int(np.argmax(total))
            raise ValueError(f"sequence {row} would reach {int(total[row])} tokens, more than the cache capacity "
                             f"max_len={cache.max_len}; create a larger cache with init_cache(batch, max_len)")


def forward_chunk(model: DeepseekV4ForCausalLM, input_ids, cache: ModelCache, lengths, trace: list | None = None):
    """The whole model for one right-padded chunk per sequence. Pure: returns new logits and a new cache.

    input_ids [B, S] int32; lengths [B] int32 valid tokens of each row (<= S); cache.lengths [B] tokens already
    consumed. -> logits [B, S, vocab] float32 (rows past lengths[b] are don't-care), cache with lengths advanced.
    Row independence: nothing a row computes reads another row's tokens, lengths or cache.
    trace: a list that receives each layer's attention inputs, in layer order (`dsv4_jax.inspect_attention`).
    """
    c = model.config
    B, S = input_ids.shape
    start = cache.lengths
    positions = start[:, None] + jnp.arange(S, dtype=jnp.int32)[None, :]
    valid = jnp.arange(S)[None, :] < lengths[:, None]
    ids = jnp.where(valid, input_ids, 0)
    h = model.embed(ids)
    streams = jnp.broadcast_to(h[:, :, None, :], (B, S, c.hc_mult, c.hidden_size))
    new_layers = []
    for block, layer_cache in zip(model.layers, cache.layers):
        streams, layer_cache = block(streams, ids, positions, start, lengths, layer_cache, cache.fmt, trace=trace)
        new_layers.append(layer_cache)
    y = hc_head_collapse(streams, model.hc_head_fn[...], model.hc_head_base[...], model.hc_head_scale[...],
                         eps=c.hc_eps, norm_eps=c.rms_norm_eps)
    logits = model.head(model.norm(y), jnp.float32)
    return logits, cache.replace(layers=tuple(new_layers), lengths=start + lengths)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def _jitted_chunk_impl(graphdef, state, cache, input_ids, lengths):
    return forward_chunk(nnx.merge(graphdef, state), input_ids, cache, lengths)


@functools.lru_cache(maxsize=8)
def _jitted_chunk_with_layouts(out_formats: tuple, treedef):
    """`_jitted_chunk_impl` returning the cache in declared layouts (one jit per set of the cache's formats)."""
    formats = jax.tree_util.tree_unflatten(treedef, out_formats)
    return jax.jit(_jitted_chunk_impl.__wrapped__, static_argnums=0, donate_argnums=2, out_shardings=(None, formats))


def _jitted_chunk(graphdef, state, input_ids, cache, lengths):
    # on platforms whose kernels want other layouts than XLA's defaults for the cache's arrays (TPU), the cache is
    # placed in them (a copy the first time only) and returned in them, so no call relays it out around a kernel
    cache, formats = place_cache(cache)
    if formats is None:
        return _jitted_chunk_impl(graphdef, state, cache, input_ids, lengths)
    leaves, treedef = jax.tree_util.tree_flatten(formats)
    return _jitted_chunk_with_layouts(tuple(leaves), treedef)(graphdef, state, cache, input_ids, lengths)
