"""Argument checks shared by every implementation of the indexer ops (the reference, the GPU and TPU kernels).

    validate(q, weights, keys, n_visible, *, k=None, query_chunk=None)

Shapes are static, so the checks run at trace time and cost nothing in a jitted program. Without them a wrong
weights or n_visible shape broadcasts silently in the reference, and the kernels read past or short of their
operands (a keys batch larger than q's was accepted and scored the wrong rows).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from . import formats

# the storage of each quantized key format: values dtype, values' last dim as a function of head_dim, scale dtype,
# scale's last dim
_STORAGE = {
    "fp8": (jnp.float8_e4m3fn, lambda d: d, jnp.float32, lambda d: 1),
    "fp4": (jnp.uint8, lambda d: d // 2, jnp.uint8, lambda d: d // formats.FP4_BLOCK),
}


def _shape(x):
    return tuple(x.shape) if hasattr(x, "shape") else None


def _is(x, kind) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, kind)


def validate(q, weights, keys, n_visible, *, k=None, query_chunk=None) -> None:
    """q [B, S, H, D] float, weights [B, S, H] float, keys [B, T, D] float or `formats.QuantizedKeys` (fp8: values
    e4m3 [B, T, D] + scale f32 [B, T, 1]; fp4: values uint8 [B, T, D / 2] + scale uint8 [B, T, D / 32]), n_visible
    [B, S] integer, k >= 1, query_chunk >= 1; ValueError naming the argument otherwise."""
    qs = _shape(q)
    if qs is None or len(qs) != 4:
        raise ValueError(f"q must be [batch, queries, heads, head_dim], got shape {qs}")
    if not _is(q, jnp.floating):
        raise ValueError(f"q must be floating point, got {q.dtype}")
    B, S, H, D = qs
    if _shape(weights) != (B, S, H):
        raise ValueError(f"weights must be [batch, queries, heads] = {(B, S, H)}, got {_shape(weights)}")
    if not _is(weights, jnp.floating):
        raise ValueError(f"weights must be floating point, got {weights.dtype}")
    if isinstance(keys, formats.QuantizedKeys):
        if keys.fmt not in _STORAGE:
            raise ValueError(f"QuantizedKeys.fmt must be one of {tuple(_STORAGE)}, got {keys.fmt!r}")
        vdtype, vcols, sdtype, scols = _STORAGE[keys.fmt]
        vs, ss = _shape(keys.values), _shape(keys.scale)
        if keys.fmt == "fp4" and D % formats.FP4_BLOCK:
            raise ValueError(f"fp4 keys need head_dim a multiple of {formats.FP4_BLOCK}, got {D}")
        if vs is None or len(vs) != 3 or vs[0] != B or vs[2] != vcols(D):
            raise ValueError(f"{keys.fmt} keys' values must be [batch={B}, T, {vcols(D)}] for head_dim {D}, got {vs}")
        if ss != vs[:2] + (scols(D),):
            raise ValueError(f"{keys.fmt} keys' scale must be {vs[:2] + (scols(D),)}, got {ss}")
        if keys.values.dtype != vdtype or keys.scale.dtype != sdtype:
            raise ValueError(f"{keys.fmt} keys must hold {np.dtype(vdtype).name} values and "
                             f"{np.dtype(sdtype).name} scales, got {keys.values.dtype} / {keys.scale.dtype}")
        T = vs[1]
    else:
        ks = _shape(keys)
        if ks is None or len(ks) != 3 or ks[0] != B or ks[2] != D:
            raise ValueError(f"keys must be [batch={B}, T, head_dim={D}] (or formats.QuantizedKeys), got {ks}")
        if not _is(keys, jnp.floating):
            raise ValueError(f"keys must be floating point (or formats.QuantizedKeys), got {keys.dtype}")
        T = ks[1]
    if T < 1:
        raise ValueError("keys must hold at least one entry (T >= 1)")
    if _shape(n_visible) != (B, S):
        raise ValueError(f"n_visible must be [batch, queries] = {(B, S)}, got {_shape(n_visible)}")
    if not _is(n_visible, jnp.integer):
        raise ValueError(f"n_visible must be an integer array, got {getattr(n_visible, 'dtype', type(n_visible))}")
    for name, v in (("k", k), ("query_chunk", query_chunk)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1):
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
