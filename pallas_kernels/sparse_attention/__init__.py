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

fp8_pools (FP8 pools only): "kernel" (the kernel dequantizes each gathered row, spec §4.2), "dequantize" (the
FP8 pools are dequantized to bf16 once, one XLA pass over the pool, and the bf16 kernel runs), "auto" (default:
"dequantize" on a GPU where the call gathers each pool row `DEQUANT_MIN_REUSE` times or more on average, its bf16
copy stays under `DEQUANT_MAX_BYTES`, the Mosaic kernel takes the bf16 pools and no kernel option is given; else
"kernel"; see `dequantize_first`).
Prefill gathers every pool row hundreds of times (S queries x 640 entries over ~S + S/4 rows), so converting
each row once instead of at every gather takes FP8 prefill to the bf16 kernel's speed; decode gathers a row about
once and keeps the in-kernel dequantization, which moves 584 B a row instead of 1024. vLLM's DeepSeek-V3.2 sparse
MLA prefill does the same (its FP8 cache is upconverted to a bf16 workspace before FlashMLA's bf16 sparse prefill).
Both give the kernel the same bf16 operands (e4m3 x 2^e is exact in bf16).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import common
from ..dispatch import resolve_impl as _resolve
from .fp8_layout import Fp8KVPool, dequantize_kv_fp8, from_packed_u8, quantize_kv_fp8, to_packed_u8
from .reference import sparse_attention as sparse_attention_reference

__all__ = [
    "sparse_attention",
    "GPU_KERNELS",
    "FP8_POOL_MODES",
    "dequantize_first",
    "mosaic_applies",
    "sparse_attention_reference",
    "Fp8KVPool",
    "quantize_kv_fp8",
    "dequantize_kv_fp8",
    "to_packed_u8",
    "from_packed_u8",
]



GPU_KERNELS = ("auto", "mosaic", "triton")
FP8_POOL_MODES = ("auto", "kernel", "dequantize")
# fp8_pools="auto" dequantizes first when the call gathers >= DEQUANT_MIN_REUSE entries per pool row. Break-even
# on the H200 (session 28): the in-kernel conversion costs the FP8 kernel ~0.14 ns per gathered row over the bf16
# kernel (prefill: 270 vs 377 TFLOP/s at 64 heads, 128 K FLOP a row), one dequantization pass ~0.5 ns per pool
# row (584 B read + 1024 B written at ~3.3 TB/s): a reuse of ~3.6.
DEQUANT_MIN_REUSE = 4
DEQUANT_MAX_BYTES = 2 << 30   # largest bf16 copy of the pools "auto" makes (a transient of the jitted program)
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


def dequantize_first(q, window_kv, window_idx, compressed_kv, compressed_idx, *, mode: str = "auto",
                     target: str = "gpu", kernel_options=None, kernel: str = "auto", out_dtype=None) -> bool:
    """Whether the FP8 pools of this call are dequantized to bf16 once before the kernel (see `fp8_pools` in the
    module docstring). "auto": on a GPU only, with no kernel option given (a tuned call keeps the kernel it tunes),
    where the Mosaic kernel takes the bf16 pools (bf16 q with 64 / 128 heads, bf16 output, kernel "auto" or
    "mosaic": the measured case), when gathered entries B * T * (k_window + k_compressed) >= DEQUANT_MIN_REUSE x the
    pools' rows and the bf16 copy is at most DEQUANT_MAX_BYTES."""
    if mode not in FP8_POOL_MODES:
        raise ValueError(f"fp8_pools must be one of {FP8_POOL_MODES}, got {mode!r}")
    pools = [(p_, i_) for p_, i_ in ((window_kv, window_idx), (compressed_kv, compressed_idx)) if p_ is not None]
    fp8_rows = sum(p_.shape[0] for p_, _ in pools if isinstance(p_, Fp8KVPool))
    if mode == "kernel" or fp8_rows == 0:
        return False
    if mode == "dequantize":
        return True
    if target != "gpu" or kernel_options or kernel == "triton":
        return False
    as_bf16 = [None if p_ is None else jax.ShapeDtypeStruct(p_.shape, jnp.bfloat16) for p_ in (window_kv, compressed_kv)]
    if not mosaic_applies(q, *as_bf16, out_dtype=out_dtype):
        return False
    b, t = q.shape[:2]
    gathered = b * t * sum(i_.shape[-1] for _, i_ in pools)
    rows = sum(p_.shape[0] for p_, _ in pools)
    return gathered >= DEQUANT_MIN_REUSE * rows and fp8_rows * q.shape[-1] * 2 <= DEQUANT_MAX_BYTES


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
    fp8_pools = kernel_options.pop("fp8_pools", "auto")
    target = resolve_impl(impl)
    if dequantize_first(q, window_kv, window_idx, compressed_kv, compressed_idx, mode=fp8_pools, target=target,
                        kernel_options=kernel_options, kernel=kernel, out_dtype=out_dtype) and target != "reference":
        # one pass over each FP8 pool; the kernel then reads bf16 rows (the same values it would convert itself)
        window_kv, compressed_kv = (dequantize_kv_fp8(p_, jnp.bfloat16) if isinstance(p_, Fp8KVPool) else p_
                                    for p_ in (window_kv, compressed_kv))
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
