"""Sparse window + compressed attention with sink: dispatcher over the reference and the Pallas kernels.

    sparse_attention(q, window_kv, window_idx, compressed_kv, compressed_idx, sinks, *, scale,
                     window_len=None, compressed_len=None, out_dtype=None, return_lse=False,
                     impl="auto", **kernel_options)

impl: "reference" (plain jnp), "pallas" (GPU: Triton-backend Pallas kernel; TPU: Mosaic TPU kernel; CPU: the GPU
kernel in the Pallas interpreter, slow, for tests), "auto" (pallas on GPU/TPU, reference on CPU).
Pools may be plain [rows, 512] arrays or `Fp8KVPool` (spec §4.2 FP8 rows; see `fp8_layout`).
`kernel_options` (tuning knobs such as block_k, n_splits) go to the kernel and are ignored by the reference.
"""

from __future__ import annotations

import jax

from . import common
from ..dispatch import resolve_impl as _resolve
from .fp8_layout import Fp8KVPool, dequantize_kv_fp8, from_packed_u8, quantize_kv_fp8, to_packed_u8
from .reference import sparse_attention as sparse_attention_reference

__all__ = [
    "sparse_attention",
    "sparse_attention_reference",
    "Fp8KVPool",
    "quantize_kv_fp8",
    "dequantize_kv_fp8",
    "to_packed_u8",
    "from_packed_u8",
]



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
    target = resolve_impl(impl)
    if target == "reference":
        return sparse_attention_reference(q, window_kv, window_idx, compressed_kv, compressed_idx, sinks, **kw)
    if target in ("gpu", "interpret"):
        from .gpu import sparse_attention_gpu

        return sparse_attention_gpu(q, window_kv, window_idx, compressed_kv, compressed_idx, sinks, **kw,
                                    interpret=(target == "interpret"), **kernel_options)
    from .tpu import sparse_attention_tpu

    return sparse_attention_tpu(q, window_kv, window_idx, compressed_kv, compressed_idx, sinks, **kw, **kernel_options)
