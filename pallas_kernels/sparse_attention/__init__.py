"""Sparse window + compressed attention with sink: dispatcher over the reference and the Pallas kernels.

    sparse_attention(q, window_kv, window_idx, compressed_kv, compressed_idx, sinks, *, scale,
                     window_len=None, compressed_len=None, out_dtype=None, return_lse=False,
                     impl="auto", **kernel_options)

impl: "reference" (plain jnp), "pallas" (GPU: one of the two GPU kernels below; TPU: Mosaic TPU kernel; CPU: the
Triton GPU kernel in the Pallas interpreter, slow, for tests), "auto" (pallas on GPU/TPU, reference on CPU).
kernel (GPU only): "mosaic" (gpu_mosaic.py: warp-specialised, written against Mosaic GPU; bf16 q with 64 or 128 heads,
bf16 or FP8 pools, bf16 output), "triton" (gpu.py: every dtype, head count and pool, plus its tuning knobs), "auto"
(default: mosaic where it is the faster one and no Triton-only option is given, else triton). Measured on the H200
(sessions 8-9, benchmarks/mosaic_attention.py, sparse_attention.py --groups kernels): with bf16 pools mosaic is
1.0-1.6x faster for CSA/HCA decode at B >= 64 and 1.3x for CSA prefill. With FP8 pools it was 1.1-1.2x slower
until session 19; with split_d and a per-consumer half-d dequantization it is 1.6-1.8x faster in decode and 1.7x
in prefill (benchmarks/sparse_attention.py --groups s19), so auto takes FP8 pools (both FP8) to it as well.
Pools may be plain [rows, 512] arrays or `Fp8KVPool` (spec §4.2 FP8 rows; see `fp8_layout`).
`kernel_options` (tuning knobs such as block_k, n_splits) go to the kernel and are ignored by the reference.
"""

from __future__ import annotations

import functools

import jax

from . import common
from ..dispatch import resolve_impl as _resolve
from .fp8_layout import Fp8KVPool, dequantize_kv_fp8, from_packed_u8, quantize_kv_fp8, to_packed_u8
from .reference import sparse_attention as sparse_attention_reference

__all__ = [
    "sparse_attention",
    "GPU_KERNELS",
    "mosaic_applies",
    "sparse_attention_reference",
    "Fp8KVPool",
    "quantize_kv_fp8",
    "dequantize_kv_fp8",
    "to_packed_u8",
    "from_packed_u8",
]



GPU_KERNELS = ("auto", "mosaic", "triton")
MOSAIC_OPTIONS = frozenset({"block_k", "num_stages", "n_splits", "combine"})  # knobs both GPU kernels understand


@functools.lru_cache(maxsize=None)
def mosaic_only_options() -> frozenset:
    """Keyword options the Mosaic GPU kernel takes and the Triton kernel does not (kernel="auto" with one of them
    means the Mosaic kernel)."""
    import inspect

    from .gpu import sparse_attention_gpu
    from .gpu_mosaic import sparse_attention_mosaic

    kw = lambda f: {n for n, p_ in inspect.signature(f).parameters.items() if p_.kind == p_.KEYWORD_ONLY}
    return frozenset(kw(sparse_attention_mosaic) - kw(sparse_attention_gpu))


def mosaic_applies(q, window_kv, compressed_kv, out_dtype=None, kernel_options=None) -> bool:
    """Whether kernel="auto" picks the Mosaic GPU kernel (kernel_options: a dict of the call's knobs): bf16 q with a
    multiple of 64 heads (one CTA per 64) and head_dim % 128 == 0, both pools bf16 [rows, head_dim] or both FP8
    (`Fp8KVPool`; block_k 64, or 32 with the tile ring), bf16 output, only knobs it understands. FP8 pools moved
    from the Triton kernel to this one in session 19 (split_d with one staging slot: CSA decode B=64 38 vs 58 us on
    the H200); mixed bf16 / FP8 pools stay on Triton."""
    import jax.numpy as jnp

    from .gpu_mosaic import BLOCK_H

    pools = [window_kv] + ([] if compressed_kv is None else [compressed_kv])
    fp8 = [isinstance(p_, Fp8KVPool) for p_ in pools]
    opts = dict(kernel_options or {})
    if all(fp8):   # (its Mosaic-only knobs are outside MOSAIC_OPTIONS, checked below)
        # block_k 64 where the consumers convert, 32 in the tile ring of the converter (the default since session
        # 25) or the producer
        pools_ok = opts.get("block_k") in (None, 64) or (opts.get("block_k") == 32
                                                          and opts.get("fp8_dequant") != "consumers")
    else:
        pools_ok = not any(fp8) and all(p_.dtype == jnp.bfloat16 for p_ in pools)
    return (q.dtype == jnp.bfloat16 and q.shape[2] % BLOCK_H == 0 and q.shape[3] % 128 == 0 and pools_ok
            and jnp.dtype(out_dtype or q.dtype) == jnp.bfloat16
            and set(opts) <= MOSAIC_OPTIONS)


def _platform() -> str:
    return jax.default_backend()


def resolve_impl(impl: str) -> str:
    return _resolve(impl, "sparse_attention")


def sparse_attention(
    q,
    window_kv,
    window_idx,
    compressed_kv,
    compressed_idx,
    sinks,
    *,
    scale: float,
    window_len=None,
    compressed_len=None,
    out_dtype=None,
    return_lse: bool = False,
    impl: str = "auto",
    **kernel_options,
):
    """Same signature and semantics as :func:`reference.sparse_attention`, plus `impl` and kernel options."""
    common.validate(q, window_kv, window_idx, compressed_kv, compressed_idx, sinks, window_len, compressed_len, scale)
    kw = dict(scale=scale, window_len=window_len, compressed_len=compressed_len, out_dtype=out_dtype,
              return_lse=return_lse)
    kernel = kernel_options.pop("kernel", "auto")
    if kernel not in GPU_KERNELS:
        raise ValueError(f"kernel must be one of {GPU_KERNELS}, got {kernel!r}")
    target = resolve_impl(impl)
    if kernel == "mosaic" and target != "gpu":
        raise ValueError(f"kernel='mosaic' runs only on a GPU (Mosaic GPU has no interpreter); this is {target!r}")
    if target == "reference":
        return sparse_attention_reference(q, window_kv, window_idx, compressed_kv, compressed_idx, sinks, **kw)
    mosaic_only = sorted(set(kernel_options) & mosaic_only_options()) if target in ("gpu", "interpret") else []
    if mosaic_only and kernel == "auto":
        # a knob only the Mosaic kernel has asks for it: take it where it applies, else say why not (rather
        # than a TypeError from the Triton kernel)
        if target == "interpret":
            raise ValueError(f"options {mosaic_only} are the Mosaic GPU kernel's, which runs only on a GPU (Mosaic "
                             "GPU has no interpreter)")
        if not mosaic_applies(q, window_kv, compressed_kv, out_dtype,
                              {k: v for k, v in kernel_options.items() if k not in mosaic_only}):
            raise ValueError(f"options {mosaic_only} are the Mosaic GPU kernel's, which does not apply to these "
                             "inputs (see mosaic_applies)")
        kernel = "mosaic"
    if target == "gpu" and (kernel == "mosaic" or (kernel == "auto" and mosaic_applies(
            q, window_kv, compressed_kv, out_dtype, kernel_options))):
        from .gpu_mosaic import sparse_attention_mosaic

        return sparse_attention_mosaic(q, window_kv, window_idx, compressed_kv, compressed_idx, sinks, **kw,
                                       **kernel_options)
    if target in ("gpu", "interpret"):
        from .gpu import sparse_attention_gpu

        return sparse_attention_gpu(q, window_kv, window_idx, compressed_kv, compressed_idx, sinks, **kw,
                                    interpret=(target == "interpret"), **kernel_options)
    from .tpu import sparse_attention_tpu

    return sparse_attention_tpu(q, window_kv, window_idx, compressed_kv, compressed_idx, sinks, **kw, **kernel_options)
