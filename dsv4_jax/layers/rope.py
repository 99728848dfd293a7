"""Interleaved (GPT-J) partial RoPE on the trailing `rope_dim` channels, main and YaRN compress tables (spec §3.5).

Sliding-only layers use the main table (theta = rope_theta, no scaling); every compressed layer (CSA/HCA) uses the
compress table (theta = compress_rope_theta, YaRN without mscale) for everything in that layer: q, window kv,
compressed entries, indexer q/k and the inverse rotation of the output.
"""

from __future__ import annotations

import math

import numpy as np

from pallas_kernels.rope import apply_rope  # noqa: F401  (re-exported: the rotation itself)

from ..config import DeepseekV4Config


def rope_inv_freq(config: DeepseekV4Config, compressed: bool) -> tuple[float, ...]:
    """Inverse frequencies (rope_dim // 2 float32 values, as a hashable tuple so modules keep them static) of the
    main (compressed=False) or compress table."""
    return tuple(float(v) for v in _inv_freq(config, compressed))


def _inv_freq(config: DeepseekV4Config, compressed: bool) -> np.ndarray:
    dim = config.qk_rope_head_dim
    base = config.compress_rope_theta if compressed else config.rope_theta
    pos_freqs = np.float32(base) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    inv_freq = (np.float32(1.0) / pos_freqs).astype(np.float32)
    yarn = config.rope_scaling
    if not compressed or yarn is None:
        return inv_freq

    def correction_dim(n_rot):
        return dim * math.log(yarn.original_max_position_embeddings / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / np.float32(high - low), 0, 1).astype(np.float32)
    extrapolation = np.float32(1.0) - ramp  # 1 keeps the original frequency, 0 divides it by `factor`
    interpolated = (np.float32(1.0) / (np.float32(yarn.factor) * pos_freqs)).astype(np.float32)
    return (interpolated * (1 - extrapolation) + inv_freq * extrapolation).astype(np.float32)
