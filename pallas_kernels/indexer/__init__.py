"""Lightning-indexer scoring + top-k: dispatcher over the jnp reference and the Pallas kernels; key formats."""

from . import formats
from .reference import indexer_scores, indexer_topk as indexer_topk_reference

__all__ = ["formats", "indexer_scores", "indexer_topk", "indexer_topk_reference"]


def indexer_topk(*args, impl: str = "reference", **kwargs):
    """Same signature as :func:`reference.indexer_topk`, plus `impl` ("reference" | "auto" | "pallas")."""
    if impl in ("reference", "auto"):
        return indexer_topk_reference(*args, **kwargs)
    raise NotImplementedError(f"indexer_topk impl {impl!r} is not available yet")
