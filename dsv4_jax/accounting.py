"""KV-cache byte accounting for DeepSeek-V4 (spec §4).

Everything here is analytic (it needs only a :class:`~dsv4_jax.config.DeepseekV4Config`); it describes the cache a
serving system needs for one request of ``seq_len`` tokens, per layer type:

* **window**: the sliding-window ring, ``W = sliding_window`` rows of the main KV row format (every layer type has one);
* **compressor_state**: the open-window state of the compressors, fp32 ``kv_state`` + ``score_state`` of
  ``[c·r, c·d]`` each (c = 2 for the overlapping CSA compressor, 1 for HCA; spec §4.1). CSA layers carry two
  compressors: the main one (d = head_dim) and the Lightning Indexer's (d = index_head_dim, r = the layer's ratio);
* **compressed_kv**: ``seq_len // r`` emitted entries in the main KV row format;
* **indexer_keys**: CSA only, ``seq_len // r`` indexer keys in the indexer row format.

Row formats (bytes per row):

============  =============================================================================================
kv "bf16"     ``2 · head_dim`` (the reference layout, spec §4.1)
kv "fp8"      FlashMLA / vLLM ``fp8_ds_mla`` (spec §4.2): nope dims as e4m3 (1 B), rope dims as bf16 (2 B), one
              ue8m0 scale byte per 64-wide nope block, the scale area padded to a multiple of 8 bytes
              (448 + 128 + 7 + 1 = **584 B** for head_dim 512 / rope 64)
idx "bf16"    ``2 · index_head_dim``
idx "fp8"     e4m3 values + one fp32 scale per 128 values (128 + 4 = **132 B**, spec §4.3)
idx "fp4"     MXFP4: packed e2m1 (½ B) + one ue8m0 byte per 32 values (64 + 4 = **68 B**, spec §4.3)
============  =============================================================================================

:func:`per_token_bytes` is the long-context per-token figure of spec §4.5 (compressed KV + indexer keys only, i.e.
excluding the fixed-size windows and compressor states): 3850.25 / 3514.25 B for V4-Flash (FP8 / MXFP4 indexer) and
5511.4375 / 5031.4375 B for V4-Pro with ``kv_dtype="fp8"``.

:func:`dense_mla_bytes` is the comparison point: a dense latent cache (MLA-style, one ``head_dim`` row per token per
layer, no window, no compression) of every token of every layer in the same row format.

:func:`pytree_bytes` measures an actual cache pytree (sum of its arrays' ``nbytes``).
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction
from typing import Any

from dsv4_jax.config import CSA, LAYER_TYPES, SLIDING, DeepseekV4Config

KV_DTYPES = ("bf16", "fp8")
INDEXER_DTYPES = ("bf16", "fp8", "fp4")
_ALIASES = {"bfloat16": "bf16", "float8": "fp8", "fp8_e4m3": "fp8", "e4m3": "fp8", "mxfp4": "fp4", "fp4_e2m1": "fp4"}

STATE_BYTES = 4  # compressor states are fp32 (spec §3.7, §4.1)


def _norm_dtype(name: str, allowed: tuple[str, ...], what: str) -> str:
    key = _ALIASES.get(str(name).lower(), str(name).lower())
    if key not in allowed:
        raise ValueError(f"{what} must be one of {allowed}, got {name!r}")
    return key


def kv_row_bytes(config: DeepseekV4Config, kv_dtype: str = "bf16") -> int:
    """Bytes of one main-KV row (a window slot or a compressed entry) in the given layout."""
    kv_dtype = _norm_dtype(kv_dtype, KV_DTYPES, "kv_dtype")
    d, rd = config.head_dim, config.qk_rope_head_dim
    if kv_dtype == "bf16":
        return 2 * d
    nope = d - rd
    scales = math.ceil(nope / 64)
    scale_area = -(-scales // 8) * 8 if scales else 0
    return nope + 2 * rd + scale_area


def indexer_row_bytes(config: DeepseekV4Config, indexer_dtype: str = "bf16") -> int:
    """Bytes of one Lightning-Indexer key row in the given layout."""
    indexer_dtype = _norm_dtype(indexer_dtype, INDEXER_DTYPES, "indexer_dtype")
    di = config.index_head_dim
    if indexer_dtype == "bf16":
        return 2 * di
    if indexer_dtype == "fp8":
        return di + 4 * math.ceil(di / 128)
    return math.ceil(di / 2) + math.ceil(di / 32)


def compressor_state_bytes(ratio: int, dim: int, overlap: bool) -> int:
    """fp32 kv_state + score_state, each [c·r, c·d] (spec §4.1)."""
    c = 2 if overlap else 1
    return 2 * (c * ratio) * (c * dim) * STATE_BYTES


@dataclasses.dataclass(frozen=True)
class LayerTypeBytes:
    """Bytes of all layers of one type (summed over those layers and the batch)."""

    layer_type: str
    num_layers: int
    window: int = 0
    compressor_state: int = 0
    compressed_kv: int = 0
    indexer_keys: int = 0

    @property
    def total(self) -> int:
        return self.window + self.compressor_state + self.compressed_kv + self.indexer_keys

    def as_dict(self) -> dict[str, int]:
        return {"num_layers": self.num_layers, "window": self.window, "compressor_state": self.compressor_state,
                "compressed_kv": self.compressed_kv, "indexer_keys": self.indexer_keys, "total": self.total}


@dataclasses.dataclass(frozen=True)
class CacheBytes:
    """Result of :func:`cache_bytes`. ``by_type[t]`` for t in ("sliding", "csa", "hca")."""

    seq_len: int
    batch_size: int
    kv_dtype: str
    indexer_dtype: str
    by_type: dict[str, LayerTypeBytes]
    dense_mla: int  # dense latent cache of every token of every layer, same kv row format

    @property
    def total(self) -> int:
        return sum(v.total for v in self.by_type.values())

    @property
    def per_token(self) -> float:
        """Total bytes divided by (seq_len · batch): includes the amortized windows and compressor states."""
        return self.total / max(1, self.seq_len * self.batch_size)

    def __getitem__(self, key: str):
        if key == "total":
            return self.total
        if key == "dense_mla":
            return self.dense_mla
        return self.by_type[key]

    def as_dict(self) -> dict[str, Any]:
        return {"seq_len": self.seq_len, "batch_size": self.batch_size, "kv_dtype": self.kv_dtype,
                "indexer_dtype": self.indexer_dtype,
                **{t: v.as_dict() for t, v in self.by_type.items()},
                "total": self.total, "dense_mla": self.dense_mla}


def cache_bytes(config: DeepseekV4Config, seq_len: int, batch_size: int = 1, kv_dtype: str = "bf16",
                indexer_dtype: str = "bf16") -> CacheBytes:
    """Bytes of the KV cache of ``batch_size`` sequences of ``seq_len`` tokens, per layer type and in total.

    The window counts ``sliding_window`` rows even for ``seq_len < sliding_window`` (it is a fixed-size ring);
    compressed entries count complete windows only (``seq_len // ratio``).
    """
    if seq_len < 0 or batch_size < 1:
        raise ValueError(f"need seq_len >= 0 and batch_size >= 1, got seq_len={seq_len}, batch_size={batch_size}")
    kv_dtype = _norm_dtype(kv_dtype, KV_DTYPES, "kv_dtype")
    indexer_dtype = _norm_dtype(indexer_dtype, INDEXER_DTYPES, "indexer_dtype")
    row = kv_row_bytes(config, kv_dtype)
    irow = indexer_row_bytes(config, indexer_dtype)
    acc = {t: dict(num_layers=0, window=0, compressor_state=0, compressed_kv=0, indexer_keys=0) for t in LAYER_TYPES}
    for t, r in zip(config.layer_types, config.compress_ratios):
        a = acc[t]
        a["num_layers"] += 1
        a["window"] += config.sliding_window * row
        if t == SLIDING:
            continue
        n_entries = seq_len // r
        a["compressed_kv"] += n_entries * row
        a["compressor_state"] += compressor_state_bytes(r, config.head_dim, overlap=(t == CSA))
        if t == CSA:
            a["indexer_keys"] += n_entries * irow
            a["compressor_state"] += compressor_state_bytes(r, config.index_head_dim, overlap=True)
    by_type = {}
    for t, a in acc.items():
        n = a.pop("num_layers")
        by_type[t] = LayerTypeBytes(t, n, **{k: v * batch_size for k, v in a.items()})
    dense = dense_mla_bytes(config, seq_len, batch_size, kv_dtype)
    return CacheBytes(seq_len, batch_size, kv_dtype, indexer_dtype, by_type, dense)


def dense_mla_bytes(config: DeepseekV4Config, seq_len: int, batch_size: int = 1, kv_dtype: str = "bf16") -> int:
    """A dense cache of every token of every layer at head_dim in the same row format (no window, no compression)."""
    return config.num_hidden_layers * seq_len * batch_size * kv_row_bytes(config, kv_dtype)


def per_token_bytes_by_type(config: DeepseekV4Config, kv_dtype: str = "fp8",
                            indexer_dtype: str = "fp8") -> dict[str, Fraction]:
    """Long-context bytes per token per layer type (summed over the layers of that type), exact fractions.

    Counts compressed KV (row/r) and, for CSA, indexer keys (indexer row/r); windows and compressor states are
    fixed-size and excluded (spec §4.5). Sliding layers contribute 0.
    """
    row = kv_row_bytes(config, kv_dtype)
    irow = indexer_row_bytes(config, indexer_dtype)
    out = {t: Fraction(0) for t in LAYER_TYPES}
    for t, r in zip(config.layer_types, config.compress_ratios):
        if t == SLIDING:
            continue
        out[t] += Fraction(row, r)
        if t == CSA:
            out[t] += Fraction(irow, r)
    return out


def per_token_bytes(config: DeepseekV4Config, kv_dtype: str = "fp8", indexer_dtype: str = "fp8") -> float:
    """Spec §4.5 long-context KV bytes per token (all layers; windows and compressor states excluded).

    V4-Flash: 3850.25 (fp8 indexer) / 3514.25 (fp4 indexer); V4-Pro: 5511.4375 / 5031.4375 — with kv_dtype "fp8".
    """
    return float(sum(per_token_bytes_by_type(config, kv_dtype, indexer_dtype).values()))


def pytree_bytes(tree: Any) -> int:
    """Sum of ``nbytes`` over the array leaves of a pytree (e.g. an actual ``ModelCache``)."""
    import jax

    total = 0
    for leaf in jax.tree_util.tree_leaves(tree):
        nb = getattr(leaf, "nbytes", None)
        if nb is None and hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            nb = math.prod(leaf.shape) * leaf.dtype.itemsize
        total += int(nb or 0)
    return total


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


__all__ = ["CacheBytes", "LayerTypeBytes", "cache_bytes", "per_token_bytes", "per_token_bytes_by_type",
           "dense_mla_bytes", "kv_row_bytes", "indexer_row_bytes", "compressor_state_bytes", "pytree_bytes",
           "format_bytes"]
