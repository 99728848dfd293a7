"""Lightning-indexer scoring + top-k: dispatcher over the jnp reference and the Pallas kernels; key formats.

    indexer_topk(q, weights, keys, n_visible, *, k, query_chunk=256, impl="reference", picks="sorted",
                 **kernel_options)
    indexer_scores_pallas(q, weights, keys, n_visible, *, impl="pallas", **kernel_options)

impl: "reference" (plain jnp), "pallas" (GPU: Triton-backend Pallas scores kernel + top-k; TPU: Mosaic kernel +
top-k; CPU: the GPU kernel in the Pallas interpreter, slow, for tests), "auto" (pallas on GPU/TPU, reference on
CPU). `kernel_options` (precision, block_q, block_t, topk, topk_block, radix_bits, num_warps, kernel, ...) go to
the kernel and are ignored by the reference. kernel (GPU): "auto" (the Mosaic kernel for fp8- or bf16-key decode with
>= 16 query rows and no Triton tuning option, else Triton: `gpu.resolve_kernel`), "triton", or "mosaic" (the Mosaic
GPU scores kernel for fp8 and bf16 keys, `gpu_mosaic.py`). topk (every method exact, the same picks as the reference): GPU default
"threshold" (strided-group bound + Triton compaction + lax.top_k over ~4k survivors, `topk.topk_threshold`), or
"lax" | "blockwise" | "radix" | "radix4" | "grouped[N]" | "threshold_rank" | "threshold_select" | "hist" | "hist_set"
(one Triton program per row, histogram radix select: `topk_hist.py`) | "tour" | "tour_set" (the same kernel as a
tournament over segments of a row) | "threshold_set" | "auto_set"; TPU default
"lax". picks: "sorted" (best first, ties -> lower index: the reference's order) or "set" (the same entries in
ascending index order, the -1s last: all a gather-and-sum consumer such as the sparse attention needs; on the GPU
kernel path it selects topk="auto_set" -- "hist_set", "tour_set" or "threshold_set" by the rows' length and count,
where each measured faster (`gpu.resolve_set_method`), none sorting its picks -- unless another set method is given;
any other topk option is followed by the set conversion).
quantize_q=True: q arrives raw (rotated, not quantized) and the op fake-quantizes it in the keys' format, except on the
Mosaic GPU kernel's paths and the TPU kernel over fp4 keys, which quantize q themselves from a raw q with the same
result (`prepare_q`): the model's indexer passes its q this way.
Every impl checks its arguments first (`common.validate`: shapes, dtypes, key storage, k): a ValueError naming the
argument, at trace time.
"""

from __future__ import annotations

import jax

from . import formats
from .common import validate
from ..dispatch import resolve_impl as _resolve
from .reference import indexer_scores, indexer_topk as indexer_topk_reference

__all__ = ["formats", "indexer_scores", "indexer_scores_pallas", "indexer_topk", "indexer_topk_reference",
           "resolve_impl"]



def resolve_impl(impl: str) -> str:
    return _resolve(impl, "indexer_topk", extra=("interpret_tpu",))


PICKS = ("sorted", "set")


def prepare_q(q, keys, target, kernel_options, query_chunk=None):
    """quantize_q=True: q as the chosen path takes it -- fake-quantized in the keys' format (`formats.fake_quantize`),
    except where the kernel quantizes q itself and a raw q gives the same scores (`gpu.takes_raw_q`: the Mosaic
    kernel over fp8 keys, and over fp4 keys with its one-kernel q preparation; `tpu.takes_raw_q`: the TPU kernel
    over fp4 keys at its default precision), which saves the fake quantization's XLA kernels (on a TPU, also their
    relayouts of q). The kernel is chosen per query chunk (`chunking.map_query_chunks`: every chunk [B, query_chunk]
    when S > query_chunk), so the choice is made for that shape."""
    fmt = keys.fmt if isinstance(keys, formats.QuantizedKeys) else None   # bf16 / exact keys: q is not quantized
    if fmt is None:
        return q
    if target in ("gpu", "interpret"):
        from .gpu import takes_raw_q

        chunk = q if query_chunk is None or q.shape[1] <= query_chunk else \
            jax.ShapeDtypeStruct((q.shape[0], query_chunk) + q.shape[2:], q.dtype)
        if takes_raw_q(chunk, keys, target == "interpret", kernel_options):
            return q
    elif target in ("tpu", "interpret_tpu"):
        from .tpu import takes_raw_q as tpu_takes_raw_q

        if tpu_takes_raw_q(keys, kernel_options):
            return q
    return formats.fake_quantize(q, fmt)


def indexer_topk(q, weights, keys, n_visible, *, k: int, query_chunk: int = 256, impl: str = "reference",
                 picks: str = "sorted", quantize_q: bool = False, **kernel_options):
    """Same signature and results as :func:`reference.indexer_topk`, plus `impl`, `picks` ("sorted": the
    reference's order; "set": ascending index, -1s last), `quantize_q` (False: q arrives fake-quantized as the keys'
    format requires, the reference's contract; True: q arrives raw and the op gives it that quantization, skipping it
    on paths whose kernel quantizes q itself: `prepare_q`) and kernel options."""
    if picks not in PICKS:
        raise ValueError(f"picks must be one of {PICKS}, got {picks!r}")
    validate(q, weights, keys, n_visible, k=k, query_chunk=query_chunk)
    target = resolve_impl(impl)
    if quantize_q:
        q = prepare_q(q, keys, target, kernel_options, query_chunk)
    if picks == "set":
        from .topk import as_index_set

        # the GPU kernel path selects the set directly (sort-free top-k); the reference and the TPU path (default
        # top-k "lax") convert their sorted picks
        direct = target in ("gpu", "interpret")
        if direct:
            from .gpu import SET_METHODS

            direct = kernel_options.get("topk", "auto_set") in SET_METHODS
        if not direct:
            return as_index_set(indexer_topk(q, weights, keys, n_visible, k=k, query_chunk=query_chunk, impl=impl,
                                             **kernel_options))
        kernel_options = dict(kernel_options, topk=kernel_options.get("topk", "auto_set"))
    if target == "reference":
        return indexer_topk_reference(q, weights, keys, n_visible, k=k, query_chunk=query_chunk)
    if target in ("gpu", "interpret"):
        from .gpu import indexer_topk_gpu

        return indexer_topk_gpu(q, weights, keys, n_visible, k=k, query_chunk=query_chunk,
                                interpret=(target == "interpret"), **kernel_options)
    from .tpu import indexer_topk_tpu

    return indexer_topk_tpu(q, weights, keys, n_visible, k=k, query_chunk=query_chunk,
                            interpret=(target == "interpret_tpu"), **kernel_options)


def indexer_scores_pallas(q, weights, keys, n_visible, *, impl: str = "pallas", quantize_q: bool = False,
                          **kernel_options):
    """The kernels' scores [B, S, T] (same contract as `indexer_scores`); impl and quantize_q as for
    `indexer_topk`."""
    validate(q, weights, keys, n_visible)
    target = resolve_impl(impl)
    if quantize_q:
        q = prepare_q(q, keys, target, kernel_options)
    if target == "reference":
        return indexer_scores(q, weights, keys, n_visible)
    if target in ("gpu", "interpret"):
        from .gpu import indexer_scores_gpu

        return indexer_scores_gpu(q, weights, keys, n_visible, interpret=(target == "interpret"), **kernel_options)
    from .tpu import indexer_scores_tpu

    return indexer_scores_tpu(q, weights, keys, n_visible, interpret=(target == "interpret_tpu"), **kernel_options)
