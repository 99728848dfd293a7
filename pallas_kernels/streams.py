"""XLA GPU stream annotations for kernels (`jax.experimental.compute_on`'s "gpu_stream:N").

    on_stream(fn, "gpu_stream:1") -> fn run as an async XLA call on that stream (ignored off the GPU)
    with kernel_stream("gpu_stream:1"): ...   # kernels that honour it (`topk_hist.hist_select`) are traced onto it

Why per kernel, not per function: on jax 0.11.2 / its XLA an annotated computation that holds ops which compile to no
kernel (reshapes, bitcasts) fails at run time ("No ExecutionStreamId found for call-start", session 37), so only the
kernels themselves are annotated; the reshapes around them stay on the main stream, where they cost nothing.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import jax

_KERNEL_STREAM: Optional[str] = None


def on_stream(fn, stream: str):
    """fn as an XLA call on the GPU stream `stream` ("gpu_stream:N"), outputs in device memory. jax 0.10 spells the
    function form `compute_on2`, 0.11 `compute_on`."""
    if not stream.startswith("gpu_stream:"):
        raise ValueError(f"stream must be 'gpu_stream:N', got {stream!r}")
    from jax.experimental import compute_on as co

    form = getattr(co, "compute_on2", None) or co.compute_on
    return form(fn, compute_type=stream, out_memory_spaces=jax.memory.Space.Device)


@contextlib.contextmanager
def kernel_stream(stream: Optional[str]):
    """Kernels traced inside run on `stream` (None: the main stream)."""
    global _KERNEL_STREAM
    saved, _KERNEL_STREAM = _KERNEL_STREAM, stream
    try:
        yield
    finally:
        _KERNEL_STREAM = saved


def current_kernel_stream() -> Optional[str]:
    return _KERNEL_STREAM


def maybe_on_stream(fn):
    """fn on the current `kernel_stream`, or fn itself outside one."""
    return fn if _KERNEL_STREAM is None else on_stream(fn, _KERNEL_STREAM)
