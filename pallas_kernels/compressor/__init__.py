"""KV compressor chunk update: dispatcher over the jnp reference and the Pallas kernels."""

from .reference import compress_chunk as compress_chunk_reference

__all__ = ["compress_chunk", "compress_chunk_reference"]


def compress_chunk(*args, impl: str = "reference", **kwargs):
    """Same signature as :func:`reference.compress_chunk`, plus `impl` ("reference" | "auto" | "pallas")."""
    if impl in ("reference", "auto"):
        return compress_chunk_reference(*args, **kwargs)
    raise NotImplementedError(f"compress_chunk impl {impl!r} is not available yet")
