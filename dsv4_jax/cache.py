"""Explicit, immutable cache pytrees (spec §4, design.md "One chunk of a sequence").

A layer's cache holds three different things:

* `window_kv` [B, W, head_dim]: the sliding-window ring; position t lives in slot t mod W. Never full length.
* the compressor state (`CompressorState`): the projected kv and gate (+ `ape` position bias) of the still-open
  window, in float32, slot = position mod ratio; overlapping (CSA) compressors also carry the first half ("A"
  series) of the previous complete window, which the next entry pools over.
* `compressed_kv` [B, max_len // ratio, head_dim]: emitted entries (entry w pools window w, RoPE at w * ratio), and
  for CSA layers the indexer's own `indexer_state` and `indexer_keys` [B, max_len // ratio, index_head_dim].

`ModelCache.lengths` [B] counts the tokens each sequence has consumed; positions are data, shapes are static, so
prefill chunks and decode steps reuse one compiled program per shape. Every cache is passed in and returned.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import struct

from pallas_kernels.compressor import KV_FP8
from pallas_kernels.indexer import formats as idx_formats
from pallas_kernels.sparse_attention.fp8_layout import HEAD_DIM as FP8_HEAD_DIM, ROPE_DIM as FP8_ROPE_DIM
from pallas_kernels.sparse_attention.fp8_layout import quantize_kv_fp8_rows

from .config import CSA, SLIDING, DeepseekV4Config


@struct.dataclass
class CompressorState:
    """Open-window state of one compressor.

    kv, gate: [B, ratio, c * dim] float32 (c = 2 for overlapping compressors); gate already includes `ape`.
      Slot j holds the token at position (window start + j); only slots of positions already seen are meaningful.
    prev_kv, prev_gate: [B, ratio, dim] float32, the A-half of the last complete window (overlap only; zeros / -inf
      before the first window closes, which gives those slots softmax weight 0).
    """

    kv: jax.Array
    gate: jax.Array
    prev_kv: Optional[jax.Array] = None
    prev_gate: Optional[jax.Array] = None

    @classmethod
    def empty(cls, batch: int, ratio: int, dim: int, overlap: bool) -> "CompressorState":
        c = 2 if overlap else 1
        kv = jnp.zeros((batch, ratio, c * dim), jnp.float32)
        gate = jnp.zeros((batch, ratio, c * dim), jnp.float32)
        if not overlap:
            return cls(kv, gate)
        return cls(kv, gate, jnp.zeros((batch, ratio, dim), jnp.float32),
                   jnp.full((batch, ratio, dim), -jnp.inf, jnp.float32))


@struct.dataclass
class LayerCache:
    """Cache of one attention layer. Fields that a layer type does not use are None.

    window_kv: [B, W, head_dim] ring (slot = position mod W).
    compressor: CompressorState of the main compressor (CSA/HCA).
    compressed_kv: [B, max_len // ratio, head_dim] emitted entries (CSA/HCA).
    KV rows are arrays, or `Fp8KVPool`s with the same leading dims in the fp8 format.
    indexer: CompressorState of the indexer's compressor (CSA).
    indexer_keys: [B, max_len // ratio, index_head_dim] indexer key entries (CSA).
    """

    window_kv: Any
    compressor: Optional[CompressorState] = None
    compressed_kv: Any = None
    indexer: Optional[CompressorState] = None
    indexer_keys: Optional[jax.Array] = None


@dataclasses.dataclass(frozen=True)
class CacheFormat:
    """How cache rows are stored (spec §8.1). kv: None (model dtype, exact) | "bf16" | "fp8" (584 B rows);
    indexer: None | "bf16" | "fp8" (132 B) | "fp4" (68 B); indexer_rotate: Walsh-Hadamard on indexer q/k."""

    kv: Optional[str] = None
    indexer: Optional[str] = None
    indexer_rotate: bool = False

    def __post_init__(self):
        if self.kv not in (None, "bf16", "fp8"):
            raise ValueError(f"kv cache dtype must be None, 'bf16' or 'fp8', got {self.kv!r}")
        idx_formats.check_format(self.indexer)

    @property
    def compressed_key_format(self) -> Optional[str]:
        """The compressor's `key_format` for the compressed KV cache: "kv_fp8" (the 584-B rows) for an fp8 cache."""
        return KV_FP8 if self.kv == "fp8" else self.kv


@struct.dataclass
class ModelCache:
    """All layers' caches plus per-sequence lengths [B] int32. Static: `max_len` (capacity in tokens), `fmt`."""

    layers: tuple
    lengths: jax.Array
    max_len: int = struct.field(pytree_node=False)
    fmt: CacheFormat = struct.field(pytree_node=False, default=CacheFormat())

    @property
    def batch_size(self) -> int:
        return int(self.lengths.shape[0])


def encode_kv(rows: jax.Array, fmt: Optional[str], dtype=jnp.float32):
    """KV rows [..., head_dim] -> cache storage: an array in `dtype` (exact), bf16, or an Fp8KVPool whose fields
    keep the leading dims (spec §4.2: 448 e4m3 + 64 bf16 + 8 scale bytes = 584 B per row)."""
    if fmt is None:
        return rows.astype(dtype)
    if fmt == "bf16":
        return rows.astype(jnp.bfloat16)
    return quantize_kv_fp8_rows(rows)


def flatten_rows(storage, n_lead: int = 2):
    """Merges the first `n_lead` dims of KV storage (array or Fp8KVPool) into one: [B, N, ...] -> [B * N, ...]."""
    return jax.tree_util.tree_map(lambda a: a.reshape((-1,) + a.shape[n_lead:]), storage)


def check_kv_format(config: DeepseekV4Config, fmt: Optional[str]) -> None:
    if fmt == "fp8" and (config.head_dim, config.qk_rope_head_dim) != (FP8_HEAD_DIM, FP8_ROPE_DIM):
        raise ValueError(f"the FP8 KV layout (spec §4.2) is defined for head_dim {FP8_HEAD_DIM} with "
                         f"{FP8_ROPE_DIM} RoPE dims; this model has {config.head_dim} / {config.qk_rope_head_dim}")


def compressed_capacity(max_len: int, ratio: int) -> int:
    """Entries a cache of `max_len` tokens can hold for ratio `ratio` (at least 1 so shapes never vanish)."""
    return max(1, max_len // ratio)


def init_cache(config: DeepseekV4Config, batch_size: int, max_len: int, dtype=jnp.float32,
               fmt: CacheFormat = CacheFormat()) -> ModelCache:
    """An empty cache for `batch_size` sequences of up to `max_len` tokens; exact-mode rows in `dtype`."""
    if batch_size < 1 or max_len < 1:
        raise ValueError(f"batch_size and max_len must be >= 1, got {batch_size}, {max_len}")
    check_kv_format(config, fmt.kv)
    kv_rows = lambda n: encode_kv(jnp.zeros((batch_size, n, config.head_dim), jnp.float32), fmt.kv, dtype)
    layers = []
    for i in range(config.num_hidden_layers):
        kind, ratio = config.layer_types[i], config.compress_ratios[i]
        window = kv_rows(config.sliding_window)
        if kind == SLIDING:
            layers.append(LayerCache(window))
            continue
        cap = compressed_capacity(max_len, ratio)
        overlap = kind == CSA
        lc = LayerCache(
            window,
            compressor=CompressorState.empty(batch_size, ratio, config.head_dim, overlap),
            compressed_kv=kv_rows(cap),
        )
        if kind == CSA:
            lc = lc.replace(indexer=CompressorState.empty(batch_size, ratio, config.index_head_dim, True),
                            indexer_keys=idx_formats.empty((batch_size, cap, config.index_head_dim), fmt.indexer,
                                                           dtype))
        layers.append(lc)
    return ModelCache(tuple(layers), jnp.zeros((batch_size,), jnp.int32), max_len, fmt)


# ------------------------------------------------------------------------------ the cache's device layouts (TPU)
# A Pallas TPU (Mosaic) kernel takes its operands row-major, and an 8-bit operand tiled (8, 128)(4, 1) (four rows a
# 32-bit word). XLA's default TPU layouts differ for the cache's narrow arrays: an array whose minor dim is off the
# 128 lanes ([B, N, 448] e4m3, [B, N, 8] scales, [B, T, 64] fp4 keys) is column-major, and 8-bit arrays are tiled
# (32, 128)(4, 1). A cache left in the defaults is relaid out around every kernel call: once a jitted step, and inside
# an on-device decode loop twice a step (into the kernel's layout and back into the loop carry's), the whole FP8 pool
# each time (benchmarks/tpu_offline.py, `engine_*` cases). Declaring the kernels' layouts for the cache's arrays --
# placing the cache in them, and compiling the steps to return it in them -- removes those copies.
# Elsewhere XLA's defaults are already what the kernels take (row-major on GPU and CPU): no layout is declared.
TPU_KERNEL_TILING_8BIT = ((8, 128), (4, 1))


def _tpu_kernel_layout(leaf):
    """Row-major, with Mosaic's kernel-operand tiling for 8-bit arrays whose rows fill whole (8, 128) tiles (the
    kernels see [B, N, w] pools as [B * N, w], a free view only then). Scalars and vectors: XLA's default."""
    from jax.experimental.layout import Layout

    if leaf.ndim < 2:
        return None
    tiling = TPU_KERNEL_TILING_8BIT if jnp.dtype(leaf.dtype).itemsize == 1 and leaf.shape[-2] % 8 == 0 else None
    return Layout(major_to_minor=tuple(range(leaf.ndim)), tiling=tiling)


# platform -> rule(leaf) -> Layout | None. Tests add a rule for "cpu" to exercise the placement on this host.
CACHE_LAYOUT_RULES: dict[str, Any] = {"tpu": _tpu_kernel_layout}


def cache_layouts(cache, platform: str):
    """The device layouts the kernels want for `cache`'s arrays on `platform`: a list with one
    `jax.experimental.layout.Layout` (or None = XLA's default) per array, in `jax.tree_util.tree_leaves` order; None
    where no layout needs declaring."""
    rule = CACHE_LAYOUT_RULES.get(platform)
    return None if rule is None else [rule(leaf) for leaf in jax.tree_util.tree_leaves(cache)]


def _has_layout(array, layout) -> bool:
    if layout is None:
        return True
    have = array.format.layout
    if tuple(have.major_to_minor) != tuple(layout.major_to_minor):
        return False
    return layout.tiling is None or tuple(map(tuple, have.tiling)) == tuple(map(tuple, layout.tiling))


def place_cache(cache):
    """-> (cache, formats). Where the kernels on the cache's device want other layouts than XLA's defaults for its
    arrays (`cache_layouts`), the arrays not in them yet are copied into them (once, e.g. after `init_cache`), and
    formats is a pytree like the cache of `jax.experimental.layout.Format`s (layout + device): what a step that
    returns the cache declares as its out_shardings, to keep it there. Elsewhere, or for a traced cache or one
    spread over several devices: (cache itself, None)."""
    from jax.experimental.layout import Format
    from jax.sharding import SingleDeviceSharding

    leaves, treedef = jax.tree_util.tree_flatten(cache)
    first = leaves[0] if leaves else None
    if not isinstance(first, jax.Array) or isinstance(first, jax.core.Tracer) or len(first.devices()) != 1:
        return cache, None
    device = next(iter(first.devices()))
    layouts = cache_layouts(cache, device.platform)
    if layouts is None or not all(isinstance(l, jax.Array) and not isinstance(l, jax.core.Tracer) for l in leaves):
        return cache, None
    sharding = SingleDeviceSharding(device)
    fmts = [Format(layout, sharding) for layout in layouts]
    placed = [l if _has_layout(l, f.layout) else jax.device_put(l, f) for l, f in zip(leaves, fmts)]
    return jax.tree_util.tree_unflatten(treedef, placed), jax.tree_util.tree_unflatten(treedef, fmts)
