"""KV compressor chunk update: dispatcher over the jnp reference and the Pallas kernels.

    compress_chunk(kv, gate, start, n_valid, state_kv, state_gate, prev_kv, prev_gate, entries, *, ratio, overlap,
                   norm_weight, eps, inv_freq, norm_dtype=float32, encode=None,
                   key_format=UNSET, rotate=False, impl="reference", **kernel_options)

impl: "reference" (plain jnp), "pallas" (GPU: Triton-backend Pallas kernel; TPU: Mosaic TPU kernel; CPU: the GPU
kernel in the Pallas interpreter, slow, for tests), "auto" (pallas on GPU/TPU, reference on CPU).

The reference encodes through an arbitrary `encode` callable; the kernels support the formats explicitly, named by
`key_format` (None: cast to the cache dtype; "bf16" | "fp8" | "fp4": the indexer key formats of `indexer.formats`;
"kv_fp8": the main KV cache's 584-B FP8 rows, entries an `Fp8KVPool`, written by every kernel)
and `rotate` (128-point Walsh-Hadamard before quantization). Passing key_format/rotate instead of encode gives
the same results on every impl (the reference then uses `encode_for(key_format, rotate)`). A custom `encode` without
`key_format` runs on the reference with impl="auto" (the kernel cannot know the format) and raises with an explicit
kernel impl ("pallas", "interpret_tpu"). Every impl checks its arguments first (`common.validate`: shapes and
dtypes of the chunk, the state and the entries): a ValueError naming the argument, at trace time.
"""

from __future__ import annotations

import jax.numpy as jnp

from ..indexer import formats
from ..sparse_attention.fp8_layout import Fp8KVPool, quantize_kv_fp8_rows
from ..dispatch import resolve_impl as _resolve
from .common import validate
from .reference import compress_chunk as compress_chunk_reference

__all__ = ["compress_chunk", "compress_chunk_reference", "encode_for", "resolve_impl"]

UNSET = "unset"
KV_FP8 = "kv_fp8"  # the main KV cache's 584-B rows (sparse_attention.fp8_layout), entries an Fp8KVPool
KEY_FORMATS = formats.FORMATS + (KV_FP8,)   # what key_format names (every impl writes each)


def resolve_impl(impl: str) -> str:
    return _resolve(impl, "compress_chunk", extra=("interpret_tpu",))


def encode_for(key_format, rotate: bool = False, dtype=None):
    """The reference `encode` callable equivalent to (key_format, rotate); None when plain cast suffices."""
    if key_format is None and not rotate:
        return None
    if key_format == KV_FP8:
        if rotate:
            raise ValueError("the FP8 KV rows are never rotated")
        return quantize_kv_fp8_rows
    formats.check_format(key_format)

    def encode(x):
        y = formats.hadamard(x) if rotate else x
        return formats.quantize(y, key_format, dtype or x.dtype) if key_format is not None else y
    return encode


def compress_chunk(kv, gate, start, n_valid, state_kv, state_gate, prev_kv, prev_gate, entries, *, ratio: int,
                   overlap: bool, norm_weight, eps: float, inv_freq, norm_dtype=jnp.float32, encode=None,
                   key_format=UNSET, rotate: bool = False, impl: str = "reference", **kernel_options):
    """Same signature and results as :func:`reference.compress_chunk`, plus `key_format`/`rotate`, `impl` and
    kernel tuning options (ignored by the reference)."""
    validate(kv, gate, start, n_valid, state_kv, state_gate, prev_kv, prev_gate, entries, ratio=ratio,
             overlap=overlap, norm_weight=norm_weight)
    target = resolve_impl(impl)
    explicit = key_format is not UNSET
    if target != "reference" and encode is not None and not explicit:
        if impl != "auto":   # an explicit kernel request is never answered by the reference in silence
            raise ValueError(f"impl={impl!r}: the kernels write the formats named by key_format ({KEY_FORMATS}); "
                             "a custom `encode` callable runs only in the reference (impl='reference' or 'auto')")
        target = "reference"  # "auto": the reference is the one implementation that runs a custom callable
    pos = (kv, gate, start, n_valid, state_kv, state_gate, prev_kv, prev_gate, entries)
    kw = dict(ratio=ratio, overlap=overlap, norm_weight=norm_weight, eps=eps, inv_freq=inv_freq,
              norm_dtype=norm_dtype)
    if target == "reference":
        if explicit and encode is None:
            dt = None if isinstance(entries, (formats.QuantizedKeys, Fp8KVPool)) else entries.dtype
            encode = encode_for(key_format, rotate, dt)
        return compress_chunk_reference(*pos, **kw, encode=encode)
    fmt = key_format if explicit else None
    if target in ("gpu", "interpret"):
        from .gpu import compress_chunk_gpu

        return compress_chunk_gpu(*pos, **kw, key_format=fmt, rotate=rotate, interpret=(target == "interpret"),
                                  **kernel_options)
    from .tpu import compress_chunk_tpu

    return compress_chunk_tpu(*pos, **kw, key_format=fmt, rotate=rotate, interpret=(target == "interpret_tpu"),
                              **kernel_options)
