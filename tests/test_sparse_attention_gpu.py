"""Sparse attention GPU kernel (compiled, Triton backend) vs the reference on a real GPU. Skips without a GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_sparse_attention import call, check_close, make_inputs, opts_id
from pallas_kernels.sparse_attention import sparse_attention, sparse_attention_reference

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (compiled Triton Pallas kernel)")

CASES = [
    # decode-like: few queries, K = 128 window + top-k / HCA; split-K on and off
    (4, 1, 64, 128, 300, 128, 512, dict(fp8=False, ragged=True, dupes=True), {}),
    (4, 1, 64, 128, 300, 128, 512, dict(fp8=True, ragged=True, dupes=True), {}),
    (3, 2, 128, 128, 600, 128, 1024, dict(fp8=False, all_invalid_c=True), dict(n_splits=4)),
    (3, 2, 128, 128, 600, 128, 1024, dict(fp8=True, all_invalid_c=True, ragged=True), dict(n_splits=1)),
    (2, 1, 4, 128, 9000, 128, 8192, dict(fp8=False), {}),
    (2, 1, 4, 128, 9000, 128, 8192, dict(fp8=True, ragged=True), {}),
    (4, 1, 64, 128, 300, 128, 512, dict(fp8=True, ragged=True, dupes=True),
     dict(n_splits=4, fp8_scales="vector", partial_dtype=jnp.bfloat16)),
    (4, 1, 64, 128, 300, 128, 512, dict(fp8=True, ragged=True, dupes=True), dict(d_chunk=128, fp8_operands="f16")),
    (4, 1, 64, 128, 300, 128, 512, dict(fp8=True, ragged=True), dict(fp8_operands="f16")),
    (4, 1, 64, 128, 300, 128, 512, dict(fp8=False, ragged=True, dupes=True), dict(col_splits=2)),
    (3, 2, 128, 128, 600, 128, 1024, dict(fp8=True, all_invalid_c=True, ragged=True), dict(col_splits=2, n_splits=2)),
    (4, 1, 64, 128, 300, 128, 512, dict(fp8=False, ragged=True, dupes=True), dict(prefetch="idx")),
    (4, 1, 64, 128, 300, 128, 512, dict(fp8=False, ragged=True, dupes=True), dict(prefetch="rows")),
    (3, 2, 128, 128, 600, 128, 1024, dict(fp8=True, all_invalid_c=True, ragged=True), dict(prefetch="rows")),
    (1, 256, 64, 2048, 1024, 128, 512, dict(fp8=False, ragged=True, dupes=True), dict(prefetch="idx")),
    (4, 1, 64, 128, 300, 128, 512, dict(fp8=False, ragged=True, dupes=True), dict(q_reload=True)),
    (3, 2, 128, 128, 600, 128, 1024, dict(fp8=True, all_invalid_c=True, ragged=True), dict(q_reload=True)),
    (1, 256, 64, 2048, 1024, 128, 512, dict(fp8=False, ragged=True, dupes=True), dict(q_reload=True)),
    # prefill-like: many queries, each with its own list
    (1, 256, 64, 2048, 1024, 128, 512, dict(fp8=False, ragged=True, dupes=True), {}),
    (1, 256, 64, 2048, 1024, 128, 512, dict(fp8=True, all_invalid_c=True), {}),
    (1, 64, 4, 512, 200, 100, 60, dict(fp8=False, ragged=True), {}),  # K not a multiple of block_k
    # the split-K merge as one Pallas kernel
    (4, 1, 64, 128, 300, 128, 512, dict(fp8=True, ragged=True, dupes=True), dict(n_splits=4, combine="pallas")),
    (3, 2, 128, 128, 600, 128, 1024, dict(fp8=False, all_invalid_c=True, ragged=True),
     dict(n_splits=3, combine="pallas")),
    # past one wave of programs (136 rows x 130 steps): the Triton default takes `common.wave_splits`' split count
    # and the XLA merge (session 58)
    (136, 1, 64, 128, 9000, 128, 8192, dict(fp8=False, ragged=True), dict(kernel="triton")),
    (136, 1, 64, 128, 9000, 128, 8192, dict(fp8=True, ragged=True), dict(kernel="triton")),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}t{c[1]}h{c[2]}k{c[6]}_"
                         f"{'fp8' if c[7].get('fp8') else 'bf16'}{opts_id(c[8])}")
def test_gpu_kernel(case):
    b, t, h, n_w, n_c, k_w, k_c, flags, opts = case
    inp = make_inputs(b, t, h, 512, n_w, n_c, k_w, k_c, **flags)
    out = call(sparse_attention, inp, impl="pallas", poison=True, **opts)
    ref = call(sparse_attention_reference, inp)
    check_close(out, ref)


def test_gpu_auto_is_pallas_and_jits():
    inp = make_inputs(2, 1, 64, 512, 256, 1024, 128, 512, fp8=True)
    f = jax.jit(lambda i: call(sparse_attention, i, impl="auto"))
    check_close(f(inp), call(sparse_attention_reference, inp))


@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_gpu_out_dtype(out_dtype):
    inp = make_inputs(2, 3, 16, 512, 256, 512, 128, 64)
    out = call(sparse_attention, inp, impl="pallas", out_dtype=out_dtype)
    assert out[0].dtype == out_dtype
    check_close(out, call(sparse_attention_reference, inp, out_dtype=out_dtype))


# The warp-specialised Mosaic GPU kernel (gpu_mosaic.py): bf16 q with 64 heads, bf16 pools. No `poison` option, but
# check_close fails on NaN and every CTA writes its whole [64, d] tile with one bulk copy.
MOSAIC_CASES = [
    (4, 1, 128, 300, 128, 512, dict(ragged=True, dupes=True), {}),
    (3, 2, 128, 600, 128, 1024, dict(all_invalid_c=True, ragged=True), dict(n_splits=1)),
    (3, 2, 128, 600, 128, 1024, dict(all_invalid_c=True), dict(n_splits=3)),
    (2, 1, 128, 9000, 128, 8192, dict(ragged=True), {}),
    # prefill: each query its own lists (split_d by default since session 18; the schedule without either split too)
    (1, 256, 2048, 1024, 128, 512, dict(ragged=True, dupes=True), {}),
    (1, 256, 2048, 1024, 128, 512, dict(ragged=True, dupes=True), dict(split_scores=False, split_d=False)),
    (1, 64, 512, 200, 100, 60, dict(ragged=True), dict(split_scores=False)),   # K not a multiple of block_k
    # FP8 pools (spec §4.2 rows, dequantized in shared memory by the consumers)
    (4, 1, 128, 300, 128, 512, dict(ragged=True, dupes=True, fp8=True), {}),
    (3, 2, 128, 600, 128, 1024, dict(all_invalid_c=True, ragged=True, fp8=True), dict(n_splits=3)),
    (2, 1, 128, 9000, 128, 8192, dict(ragged=True, fp8=True), {}),
    (1, 256, 2048, 1024, 128, 512, dict(dupes=True, fp8=True), {}),
    (1, 64, 512, 200, 100, 60, dict(ragged=True, fp8=True), {}),
    (3, 2, 128, 600, 128, 1024, dict(ragged=True, fp8=True), dict(_diag="loop", split_d=False)),   # rolled dequant
    # registers moved from the producer to the consumers (setmaxnreg)
    (4, 1, 128, 300, 128, 512, dict(ragged=True, dupes=True), dict(regs=(40, 232))),
    (3, 2, 128, 600, 128, 1024, dict(ragged=True, fp8=True), dict(regs=(24, 240))),
    # 128 heads (V4-Pro): two head groups of 64, one CTA each; with and without split-K, prefill, FP8
    (4, 1, 128, 300, 128, 512, dict(ragged=True, dupes=True, heads=128), {}),
    (3, 2, 128, 600, 128, 1024, dict(all_invalid_c=True, ragged=True, heads=128), dict(n_splits=3)),
    (1, 64, 512, 200, 100, 60, dict(ragged=True, heads=128), {}),
    (3, 2, 128, 600, 128, 1024, dict(ragged=True, fp8=True, heads=128), dict(n_splits=2)),
    # split_scores (the prefill default in sessions 12-17): each consumer scores half the entries, the two exchange P
    # halves through shared memory
    (4, 1, 128, 300, 128, 512, dict(ragged=True, dupes=True), dict(split_scores=True)),
    (3, 2, 128, 600, 128, 1024, dict(all_invalid_c=True, ragged=True), dict(split_scores=True, n_splits=3)),
    (2, 1, 128, 9000, 128, 8192, dict(ragged=True), dict(split_scores=True)),
    (1, 256, 2048, 1024, 128, 512, dict(ragged=True, dupes=True), dict(split_scores=True)),
    (1, 64, 512, 200, 100, 60, dict(ragged=True, heads=128), dict(split_scores=True)),
    (4, 1, 128, 300, 128, 512, dict(ragged=True, dupes=True, heads=128), dict(split_scores=True)),
    # the cp.async producer (16 B per thread at the swizzled addresses instead of 128 B bulk copies)
    (4, 1, 128, 300, 128, 512, dict(ragged=True, dupes=True), dict(producer="cp_async")),
    (3, 2, 128, 600, 128, 1024, dict(all_invalid_c=True, ragged=True), dict(producer="cp_async", n_splits=3)),
    (2, 1, 128, 9000, 128, 8192, dict(ragged=True), dict(producer="cp_async")),
    (1, 256, 2048, 1024, 128, 512, dict(ragged=True, dupes=True), dict(producer="cp_async")),
    (4, 1, 128, 300, 128, 512, dict(ragged=True, dupes=True, heads=128), dict(producer="cp_async",
                                                                              split_scores=True)),
    # L2 prefetch of the rows l2_ahead steps past the ring (values unchanged: only where the rows come from)
    (4, 1, 128, 300, 128, 512, dict(ragged=True, dupes=True), dict(l2_ahead=2)),
    (3, 2, 128, 600, 128, 1024, dict(all_invalid_c=True, ragged=True, fp8=True), dict(l2_ahead=3, n_splits=3)),
    (2, 1, 128, 9000, 128, 8192, dict(ragged=True), dict(l2_ahead=4)),
    (1, 256, 2048, 1024, 128, 512, dict(ragged=True, dupes=True, heads=128), dict(l2_ahead=2)),
    # 32-entry steps (64 B swizzle, gathered with cp.async), four ring slots in the same shared memory
    (4, 1, 128, 300, 128, 512, dict(ragged=True, dupes=True), dict(block_k=32, num_stages=4)),
    (3, 2, 128, 600, 128, 1024, dict(all_invalid_c=True, ragged=True), dict(block_k=32, num_stages=4, n_splits=3)),
    (1, 64, 512, 200, 100, 60, dict(ragged=True, heads=128), dict(block_k=32, num_stages=4)),   # K % 32 != 0
    (1, 256, 2048, 1024, 128, 512, dict(ragged=True, dupes=True), dict(block_k=32, num_stages=4, split_scores=True)),
    (2, 1, 128, 9000, 128, 8192, dict(ragged=True), dict(block_k=32, num_stages=4)),
    # the split-K merge as one Pallas kernel after the Mosaic kernel
    (3, 2, 128, 600, 128, 1024, dict(all_invalid_c=True, ragged=True), dict(n_splits=3, combine="pallas")),
    (4, 1, 128, 300, 128, 512, dict(ragged=True, dupes=True, heads=128), dict(n_splits=4, combine="pallas")),
    (4, 1, 128, 300, 128, 512, dict(ragged=True, dupes=True), dict(block_k=32, num_stages=3)),
    # the split-K merge inside the kernel: a row's splits as one cluster, merged through distributed shared memory
    (3, 2, 128, 600, 128, 1024, dict(all_invalid_c=True, ragged=True), dict(n_splits=3, combine="cluster")),
    (4, 1, 128, 300, 128, 512, dict(ragged=True, dupes=True, heads=128), dict(n_splits=4, combine="cluster")),
    (4, 1, 128, 300, 128, 512, dict(ragged=True, dupes=True), dict(combine="cluster")),      # 5 splits
    (2, 1, 128, 9000, 128, 8192, dict(ragged=True), dict(combine="cluster")),                # 8 splits
    (4, 1, 128, 300, 128, 512, dict(fp8=True, ragged=True, dupes=True), dict(n_splits=2, combine="cluster")),
    (3, 2, 128, 600, 128, 1024, dict(all_invalid_c=True, ragged=True),
     dict(block_k=32, num_stages=4, n_splits=7, combine="cluster")),
    (1, 64, 512, 200, 100, 60, dict(ragged=True, heads=128), dict(combine="cluster")),       # one split: no merge
    # the CTA exits once its output tile has been read out of shared memory (default since session 17), or written
    (1, 256, 2048, 1024, 128, 512, dict(ragged=True, dupes=True), dict(store_wait="read")),
    (4, 1, 128, 300, 128, 512, dict(ragged=True, dupes=True), dict(store_wait="write", combine="cluster")),
    (3, 2, 128, 600, 128, 1024, dict(all_invalid_c=True, ragged=True, fp8=True), dict(store_wait="write", n_splits=3)),
    # the index rows' copies issued ahead of the q tile's (default since session 17), or after it
    (4, 1, 128, 300, 128, 512, dict(ragged=True, dupes=True), dict(idx_first=True)),
    (3, 2, 128, 600, 128, 1024, dict(all_invalid_c=True, ragged=True, fp8=True), dict(idx_first=False, n_splits=3)),
    (1, 256, 2048, 1024, 128, 512, dict(ragged=True, dupes=True, heads=128), dict(idx_first=False, store_wait="write")),
    # the consumers take turns at the tensor cores (pingpong)
    (4, 1, 128, 300, 128, 512, dict(ragged=True, dupes=True), dict(pingpong=True)),                  # cluster merge
    (3, 2, 128, 600, 128, 1024, dict(all_invalid_c=True, ragged=True), dict(pingpong=True, n_splits=3, combine="xla")),
    (1, 256, 2048, 1024, 128, 512, dict(ragged=True, dupes=True, heads=128), dict(pingpong=True, split_scores=False)),
    (1, 64, 512, 200, 100, 60, dict(ragged=True), dict(pingpong=True, split_scores=False, n_splits=1)),
    (2, 1, 128, 9000, 128, 8192, dict(ragged=True), dict(pingpong=True, combine="xla")),             # 8 splits
    # the cluster merge with every remote read issued before the merges (cluster_loads="early")
    (3, 2, 128, 600, 128, 1024, dict(all_invalid_c=True, ragged=True),
     dict(n_splits=3, combine="cluster", cluster_loads="early")),
    (4, 1, 128, 300, 128, 512, dict(ragged=True, dupes=True, heads=128),
     dict(n_splits=4, combine="cluster", cluster_loads="early")),
    (4, 1, 128, 300, 128, 512, dict(ragged=True, dupes=True), dict(combine="cluster", cluster_loads="early")),  # 5
    (2, 1, 128, 9000, 128, 8192, dict(ragged=True), dict(combine="cluster", cluster_loads="early")),           # 8
    (4, 1, 128, 300, 128, 512, dict(fp8=True, ragged=True, dupes=True),
     dict(n_splits=2, combine="cluster", cluster_loads="early")),
    (3, 2, 128, 600, 128, 1024, dict(all_invalid_c=True, ragged=True),
     dict(block_k=32, num_stages=4, n_splits=7, combine="cluster", cluster_loads="early")),
    (4, 1, 128, 300, 128, 512, dict(ragged=True, dupes=True), dict(combine="cluster", cluster_loads="per_unit")),
    # each consumer scores half of d and they swap f32 partials (split_d); the sinks | lse share the exchange buffer
    (4, 1, 128, 300, 128, 512, dict(ragged=True, dupes=True), dict(split_d=True)),                  # cluster merge
    (4, 1, 128, 300, 128, 512, dict(ragged=True, dupes=True), dict(split_d=True, n_splits=1)),      # one split
    (3, 2, 128, 600, 128, 1024, dict(all_invalid_c=True, ragged=True), dict(split_d=True, n_splits=3, combine="xla")),
    (2, 1, 128, 9000, 128, 8192, dict(ragged=True), dict(split_d=True)),
    (1, 256, 2048, 1024, 128, 512, dict(ragged=True, dupes=True, heads=128), dict(split_d=True)),   # prefill
    (1, 64, 512, 200, 100, 60, dict(ragged=True), dict(split_d=True, block_k=32, num_stages=4)),
    (3, 2, 128, 600, 128, 1024, dict(all_invalid_c=True, ragged=True), dict(split_d=True, n_splits=4, combine="cluster")),
    # FP8 pools with split_d: one staging slot (the FP8 default since session 19)
    (4, 1, 128, 300, 128, 512, dict(fp8=True, ragged=True, dupes=True), dict(split_d=True, num_stages=1)),
    (3, 2, 128, 600, 128, 1024, dict(all_invalid_c=True, ragged=True, fp8=True),
     dict(split_d=True, num_stages=1, n_splits=3, combine="xla")),
    (4, 1, 128, 300, 128, 512, dict(fp8=True, ragged=True, dupes=True), dict(num_stages=1, split_d=False)),   # 1 slot
    # FP8 without split_d, two staging slots (the FP8 default before session 19)
    (3, 2, 128, 600, 128, 1024, dict(all_invalid_c=True, ragged=True, fp8=True), dict(num_stages=2)),
    (2, 1, 128, 9000, 128, 8192, dict(ragged=True, fp8=True), dict(num_stages=2)),
    # FP8 split_d with both consumers dequantizing the whole tile (the default: each its own half of d)
    (4, 1, 128, 300, 128, 512, dict(fp8=True, ragged=True, dupes=True),
     dict(split_d=True, num_stages=1, _diag="dequant_both")),
    # FP8 dequantized with one conversion per pair (fp8_convert="rebias"), scale bytes over ~20 binades
    (4, 1, 128, 300, 128, 512, dict(fp8=True, ragged=True, dupes=True, wide_scales=True), dict(fp8_convert="rebias")),
    (3, 2, 128, 600, 128, 1024, dict(all_invalid_c=True, ragged=True, fp8=True, wide_scales=True),
     dict(fp8_convert="rebias", split_d=True, num_stages=1, n_splits=3, combine="xla")),
    (2, 1, 128, 9000, 128, 8192, dict(ragged=True, fp8=True, wide_scales=True),
     dict(fp8_convert="rebias", split_d=True, num_stages=1)),
    (1, 256, 2048, 1024, 128, 512, dict(dupes=True, fp8=True, wide_scales=True), dict(fp8_convert="rebias")),
    (3, 2, 128, 600, 128, 1024, dict(ragged=True, fp8=True, heads=128, wide_scales=True),
     dict(fp8_convert="rebias", n_splits=2)),
    (4, 1, 128, 300, 128, 512, dict(fp8=True, ragged=True, wide_scales=True), {}),   # the default conversion
    # FP8 + split_d with each 64-column piece's score wgmma issued while the next piece converts (fp8_overlap)
    (4, 1, 128, 300, 128, 512, dict(fp8=True, ragged=True, dupes=True, wide_scales=True), dict(fp8_overlap=True)),
    (3, 2, 128, 600, 128, 1024, dict(all_invalid_c=True, ragged=True, fp8=True),
     dict(fp8_overlap=True, n_splits=3, combine="xla")),
    (2, 1, 128, 9000, 128, 8192, dict(ragged=True, fp8=True), dict(fp8_overlap=True)),
    (1, 256, 2048, 1024, 128, 512, dict(dupes=True, fp8=True), dict(fp8_overlap=True)),
    (3, 2, 128, 600, 128, 1024, dict(ragged=True, fp8=True, heads=128), dict(fp8_overlap=True, n_splits=2)),
    (4, 1, 128, 300, 128, 512, dict(fp8=True, ragged=True, wide_scales=True), dict(fp8_overlap=True,
                                                                                  fp8_convert="rebias")),
    # FP8 dequantized outside the consumers into a ring of 32-row bf16 tiles: by the producer warpgroup
    # (fp8_dequant="producer") or by a fourth warpgroup (fp8_dequant="converter", 512 threads per CTA; written in
    # session 22, not yet run), each on the same cases (see TILE_RING_CASES)
    (4, 1, 128, 300, 128, 512, dict(fp8=True, ragged=True, wide_scales=True),
     dict(fp8_dequant="producer", fp8_convert="cvt", num_stages=2)),
]


TILE_RING_CASES = [
    (4, 1, 128, 300, 128, 512, dict(fp8=True, ragged=True, dupes=True, wide_scales=True), {}),   # cluster merge
    (3, 2, 128, 600, 128, 1024, dict(all_invalid_c=True, ragged=True, fp8=True), dict(n_splits=3, combine="xla")),
    (2, 1, 128, 9000, 128, 8192, dict(ragged=True, fp8=True), {}),
    (1, 256, 2048, 1024, 128, 512, dict(dupes=True, fp8=True), {}),                                # prefill
    (3, 2, 128, 600, 128, 1024, dict(ragged=True, fp8=True, heads=128), dict(n_splits=2)),
    (1, 64, 512, 200, 100, 60, dict(ragged=True, fp8=True), dict(n_splits=1, num_stages=1)),
]
MOSAIC_CASES += [(*c[:7], dict(fp8_dequant=mode, **c[7]))
                 for mode in ("producer", "converter") for c in TILE_RING_CASES]
# the converter and the producer share each step's conversion (conv_units of the 9 passes to the converter)
MOSAIC_CASES += [(*c[:7], dict(fp8_dequant="converter", conv_units=5, **c[7])) for c in TILE_RING_CASES]
MOSAIC_CASES += [(*c[:7], dict(fp8_dequant="converter", conv_units=u, **c[7]))
                 for u in (1, 7) for c in TILE_RING_CASES[:2]]
# the converter's conversion with one conversion instruction a pair (fp8_convert="rebias", its default in sessions
# 22-66; "cvt" since session 67) and with none (_diag="bits", exact), scale bytes over ~20 binades
MOSAIC_CASES += [(*c[:6], dict(c[6], wide_scales=True), dict(fp8_dequant="converter", **o, **c[7]))
                 for o in (dict(fp8_convert="rebias"), dict(_diag="bits")) for c in TILE_RING_CASES[:4]]
# the consumers' own conversion (the FP8 default before session 25: each consumer its half of d, split_d)
MOSAIC_CASES += [(*c[:7], dict(fp8_dequant="consumers", **c[7])) for c in TILE_RING_CASES[:4]]
# the diagonal chunk order (fp8_chunk_order): every conversion path
MOSAIC_CASES += [(*c[:7], dict(fp8_chunk_order="diagonal", **c[7])) for c in [
    *[(*c[:7], dict(fp8_dequant="consumers", **c[7])) for c in TILE_RING_CASES[:5]],   # consumers, halves
    (3, 2, 128, 600, 128, 1024, dict(all_invalid_c=True, ragged=True, fp8=True), dict(num_stages=2)),  # both
    (4, 1, 128, 300, 128, 512, dict(fp8=True, ragged=True, wide_scales=True), dict(fp8_overlap=True)),
    *[(*c[:7], dict(fp8_dequant=m, **c[7])) for m in ("producer", "converter") for c in TILE_RING_CASES[:4]],
    *[(*c[:7], dict(fp8_dequant="converter", conv_units=5, **c[7])) for c in TILE_RING_CASES[:4]],
]]
# a three-tile bf16 ring next to two staging slots (built in session 25, not yet run on the GPU)
MOSAIC_CASES += [(*c[:7], dict(fp8_dequant=m, tile_slots=3, num_stages=2, **c[7]))
                 for m in ("converter", "producer") for c in TILE_RING_CASES[:4]]
# ... on session 71's FP8 defaults at the register splits group s72 times (session 72: the converter at 64)
MOSAIC_CASES += [(*c[:7], dict(tile_slots=3, num_stages=2, regs=r, **c[7]))
                 for r in ((40, 64, 184, 224), (32, 64, 184, 232)) for c in TILE_RING_CASES[:4]]
# a converting thread's chunks loaded in batches before their stores (conv_batch; session 26)
MOSAIC_CASES += [(*c[:7], dict(conv_batch=n, **c[7])) for n in (2, 3, 9) for c in TILE_RING_CASES[:4]]
MOSAIC_CASES += [(*c[:7], dict(fp8_dequant="converter", conv_units=5, conv_batch=3, **c[7]))
                 for c in TILE_RING_CASES[:2]]
# the lazy rescale of the output accumulator (lazy_rescale; session 26, the FP8 default since): bf16 and FP8 pools,
# decode, prefill (split_scores off), 128 heads, split-K with both merges, one step per split; wide score ranges
# move m often
MOSAIC_CASES += [(*c[:7], dict(lazy_rescale=True, **c[7])) for c in [
    *TILE_RING_CASES,
    (4, 1, 128, 300, 128, 512, dict(ragged=True, dupes=True), {}),
    (3, 2, 128, 600, 128, 1024, dict(all_invalid_c=True, ragged=True, heads=128), dict(n_splits=3, combine="xla")),
    (1, 256, 2048, 1024, 128, 512, dict(dupes=True), dict(split_scores=False)),
    (2, 1, 128, 9000, 128, 8192, dict(ragged=True, wide_scales=True), {}),
    (4, 1, 128, 300, 128, 512, dict(fp8=True, ragged=True), dict(fp8_dequant="consumers")),
]]
# ... and the eager rescale every step (the bf16 default; the FP8 one before session 26)
MOSAIC_CASES += [(*c[:7], dict(lazy_rescale=False, **c[7])) for c in [
    TILE_RING_CASES[0], TILE_RING_CASES[2], (3, 2, 128, 600, 128, 1024, dict(ragged=True, heads=128), {})]]


# fp8_dequant="direct" (session 55): the producer loads the raw rows from global memory into registers and converts
# them into a ring of 64-row bf16 tiles (no staging): every tile-ring case (num_stages does not apply), 32-row tiles,
# each batch size from one chunk to a whole step, the "cvt" conversion, the streamed index ring, and B=16 HCA-8K
DIRECT_CASES = [(*c[:7], {k: v for k, v in c[7].items() if k != "num_stages"}) for c in TILE_RING_CASES]
MOSAIC_CASES += [(*c[:7], dict(fp8_dequant="direct", **c[7])) for c in DIRECT_CASES]
MOSAIC_CASES += [(*c[:7], dict(fp8_dequant="direct", **o, **c[7])) for o in (
    dict(block_k=32), dict(block_k=32, tile_slots=2), dict(fp8_convert="cvt"), dict(idx_stream=True),
    dict(block_k=32, tile_slots=3), dict(direct_staging="tile", lazy_rescale=False)) for c in DIRECT_CASES[:3]]
MOSAIC_CASES += [(16, 1, 128, 9000, 128, 8192, dict(ragged=True, fp8=True), dict(fp8_dequant="direct"))]
# ... with the raw rows in the producer's registers instead of the tile (direct_staging; the default is "tile")
MOSAIC_CASES += [(*c[:7], dict(fp8_dequant="direct", direct_staging="registers", **c[7])) for c in DIRECT_CASES]
MOSAIC_CASES += [(*c[:7], dict(fp8_dequant="direct", direct_staging="registers", conv_batch=b, **c[7]))
                 for b in (1, 18) for c in DIRECT_CASES[:3]]
# ... with and without asking L2 for the next step's rows (direct_prefetch), whole and streamed index rows
MOSAIC_CASES += [(*c[:7], dict(fp8_dequant="direct", direct_prefetch=pf, **o, **c[7]))
                 for pf in (False, True) for o in ({}, dict(idx_stream=True)) for c in DIRECT_CASES[:3]]
MOSAIC_CASES += [(*c[:7], dict(fp8_dequant="direct", direct_staging="registers", direct_prefetch=True, **c[7]))
                 for c in DIRECT_CASES[:3]]


# the index rows streamed through a ring of a few steps' entries (idx_stream; session 29): long lists with one or
# two splits (the case the ring is for), many short splits (a source change within a CTA's first steps), all-invalid
# and ragged lists, prefill (split_d, split_scores), 128 heads, pingpong, and each FP8 conversion path
STREAM_CASES = [
    (2, 1, 128, 9000, 128, 8192, dict(ragged=True), dict(n_splits=2)),                           # cluster merge
    (2, 1, 128, 9000, 128, 8192, dict(ragged=True, wide_scales=True), dict(n_splits=1, lazy_rescale=True)),
    (2, 1, 128, 9000, 128, 8192, dict(ragged=True), dict(n_splits=3, combine="xla", split_d=False)),
    (4, 1, 128, 300, 128, 512, dict(ragged=True, dupes=True), {}),
    (3, 2, 128, 600, 128, 1024, dict(all_invalid_c=True, ragged=True), dict(n_splits=1)),
    (1, 256, 2048, 1024, 128, 512, dict(ragged=True, dupes=True), {}),
    (1, 64, 512, 200, 100, 60, dict(ragged=True), dict(split_scores=True, split_d=False)),
    (3, 2, 128, 600, 128, 1024, dict(ragged=True, heads=128), dict(n_splits=1)),
    (4, 1, 128, 300, 128, 512, dict(ragged=True, dupes=True), dict(pingpong=True, split_d=False)),
    (2, 1, 128, 9000, 128, 8192, dict(ragged=True, fp8=True, wide_scales=True), dict(n_splits=2)),
    (2, 1, 128, 9000, 128, 8192, dict(ragged=True, fp8=True), dict(n_splits=1, fp8_dequant="consumers")),
    (2, 1, 128, 9000, 128, 8192, dict(ragged=True, fp8=True), dict(n_splits=2, fp8_dequant="producer")),
    (2, 1, 128, 9000, 128, 8192, dict(ragged=True, fp8=True), dict(n_splits=2, fp8_dequant="consumers",
                                                                    split_d=False, num_stages=2)),
    (3, 2, 128, 600, 128, 1024, dict(all_invalid_c=True, ragged=True, fp8=True), dict(n_splits=3, combine="xla")),
    (1, 64, 512, 200, 100, 60, dict(ragged=True, fp8=True), dict(n_splits=1)),
]
MOSAIC_CASES += [(*c[:7], dict(idx_stream=True, **c[7])) for c in STREAM_CASES]
# ... and where the default streams by itself: B=16 x (128 + 8192) entries (8 splits of 17 blocks: whole lists
# would not fit next to split_d's buffer), bf16 and FP8
MOSAIC_CASES += [(16, 1, 128, 9000, 128, 8192, dict(ragged=True, fp8=f), {}) for f in (False, True)]

# the ring's full barriers per piece of d (piece_barriers, session 56): decode with the cluster merge, one split,
# the XLA merge with all-invalid lists, a long list (streamed index rows, whole ones at 2 splits), prefill,
# 128 heads, a one-slot ring, K not a multiple of block_k
PIECE_CASES = [
    (4, 1, 128, 300, 128, 512, dict(ragged=True, dupes=True), {}),
    (3, 2, 128, 600, 128, 1024, dict(all_invalid_c=True, ragged=True), dict(n_splits=1)),
    (3, 2, 128, 600, 128, 1024, dict(all_invalid_c=True), dict(n_splits=3, combine="xla")),
    (2, 1, 128, 9000, 128, 8192, dict(ragged=True), {}),
    (2, 1, 128, 9000, 128, 8192, dict(ragged=True), dict(idx_stream=True, n_splits=2)),
    (16, 1, 128, 9000, 128, 8192, dict(ragged=True), {}),
    (1, 256, 2048, 1024, 128, 512, dict(ragged=True, dupes=True), {}),
    (3, 2, 128, 600, 128, 1024, dict(ragged=True, heads=128), dict(n_splits=2)),
    (4, 1, 128, 300, 128, 512, dict(ragged=True), dict(num_stages=1, n_splits=1)),   # one slot: every step waits
    (1, 64, 512, 200, 100, 60, dict(ragged=True), {}),
]
MOSAIC_CASES += [(*c[:7], dict(piece_barriers=how, **c[7])) for how in (True, "pieces") for c in PIECE_CASES]
# B=32 CSA decode: the default 4 splits' 32 clusters do not fit on an H100 / H200 at once, so the default takes 3
# splits in clusters (`_fewer_splits_that_fit`, session 56), bf16 and FP8 pools
MOSAIC_CASES += [(32, 1, 128, 300, 128, 512, dict(ragged=True, dupes=True, fp8=f), {}) for f in (False, True)]
# B=136 x (128 + 8192) entries: past one wave of CTAs, the default takes several splits and the XLA merge
# (`wave_splits`, session 57), bf16 and FP8 pools
MOSAIC_CASES += [(136, 1, 128, 9000, 128, 8192, dict(ragged=True, fp8=f), {}) for f in (False, True)]
MOSAIC_CASES += [(72, 1, 128, 9000, 128, 8192, dict(ragged=True, heads=128), {})]   # 144 CTA rows: two head groups

# the next step's score wgmma in flight under this step's softmax (score_ahead, session 61): the FP8 tile ring
# (three tiles, two staging slots by default) on every tile-ring case, with the converter sharing the conversion,
# the eager rescale and streamed index rows; bf16 rings of 32-row (four slots) and 64-row (two) steps; ragged
# lengths leave some split CTAs without steps (no scores before the loop) and others with one
AHEAD_CASES = [
    *TILE_RING_CASES,
    (4, 1, 128, 300, 128, 512, dict(fp8=True, ragged=True, dupes=True), dict(conv_units=5)),
    (2, 1, 128, 9000, 128, 8192, dict(ragged=True, fp8=True, wide_scales=True), dict(lazy_rescale=False)),
    (2, 1, 128, 9000, 128, 8192, dict(ragged=True, fp8=True), dict(idx_stream=True, n_splits=2)),
    (3, 2, 128, 600, 128, 1024, dict(ragged=True, fp8=True), dict(n_splits=8, combine="xla")),
    (4, 1, 128, 300, 128, 512, dict(ragged=True, dupes=True), dict(block_k=32, num_stages=4)),
    (2, 1, 128, 9000, 128, 8192, dict(ragged=True, wide_scales=True), dict(block_k=32, num_stages=4)),
    (3, 2, 128, 600, 128, 1024, dict(all_invalid_c=True, ragged=True, heads=128), dict(block_k=32, num_stages=4,
                                                                                       n_splits=3, combine="xla")),
    (1, 256, 2048, 1024, 128, 512, dict(ragged=True, dupes=True), dict(block_k=32, num_stages=4)),   # prefill
    (4, 1, 128, 300, 128, 512, dict(ragged=True, dupes=True), {}),
    (2, 1, 128, 9000, 128, 8192, dict(ragged=True), dict(idx_stream=True, n_splits=2)),
]
MOSAIC_CASES += [(*c[:7], dict(score_ahead=True, **c[7])) for c in AHEAD_CASES]

# FlashMLA's consumer split (consumers="asym", session 64): consumer 0 scores and hands P and alpha to consumer 1
# through shared memory (faster for bf16 on an H100, session 65). The piece-barrier cases (every list shape, split
# count and merge, prefill, 128 heads, one ring slot), plus the lazy rescale, a wave past 132 CTAs and the cluster
# merge (three 64 KB slots of d = 512 do not fit next to q: the wrapper refuses them, H100 session 65)
ASYM_CASES = [
    *PIECE_CASES,
    (2, 1, 128, 9000, 128, 8192, dict(ragged=True, wide_scales=True), dict(lazy_rescale=True)),
    (3, 2, 128, 600, 128, 1024, dict(all_invalid_c=True, ragged=True), dict(lazy_rescale=True, n_splits=4,
                                                                           combine="cluster")),
    (136, 1, 128, 9000, 128, 8192, dict(ragged=True), {}),
]
MOSAIC_CASES += [(*c[:7], dict(consumers="asym", **c[7])) for c in ASYM_CASES]
# ... and FlashMLA's whole FP8 shape: the split over the producer's direct gather of FP8 rows (fp8_dequant="direct")
ASYM_FP8_CASES = [
    (4, 1, 128, 300, 128, 512, dict(ragged=True, dupes=True, fp8=True), {}),
    (3, 2, 128, 600, 128, 1024, dict(all_invalid_c=True, ragged=True, fp8=True), dict(n_splits=3, combine="xla")),
    (2, 1, 128, 9000, 128, 8192, dict(ragged=True, fp8=True, wide_scales=True), dict(idx_stream=True, n_splits=2)),
    (3, 2, 128, 600, 128, 1024, dict(ragged=True, fp8=True, heads=128), dict(lazy_rescale=False)),
    (4, 1, 128, 300, 128, 512, dict(ragged=True, fp8=True), dict(direct_staging="registers")),
    (1, 256, 2048, 1024, 128, 512, dict(ragged=True, dupes=True, fp8=True), {}),   # prefill
]
MOSAIC_CASES += [(*c[:7], dict(consumers="asym", fp8_dequant="direct", **c[7])) for c in ASYM_FP8_CASES]
# ... and over the converter warpgroup's 32-row tiles (session 67; the FP8 default since session 68, when these passed
# on an H100 once the P slots were 1 KB aligned): every tile-ring case, the producer sharing the conversion, the eager
# rescale; and the pair over the same tiles (the FP8 default of sessions 25-67), now named
MOSAIC_CASES += [(*c[:7], dict(consumers="asym", fp8_dequant="converter", **o, **c[7]))
                 for o, cs in (({}, TILE_RING_CASES), (dict(conv_units=5), TILE_RING_CASES[:2]),
                               (dict(lazy_rescale=False), TILE_RING_CASES[:1])) for c in cs]
MOSAIC_CASES += [(*c[:7], dict(consumers="pair", fp8_dequant="converter", **c[7])) for c in TILE_RING_CASES]
# ... with f16 tensor-core operands (fp8_operands="f16", session 69): every tile-ring case, scale bytes over ~20
# binades (values down into f16's subnormals), the producer sharing the conversion, the conversion unrolled in
# batches of two (with the registers that keep it from spilling), the eager rescale
F16_ASYM = dict(consumers="asym", fp8_dequant="converter", fp8_operands="f16")
MOSAIC_CASES += [(*c[:7], dict(F16_ASYM, **o, **c[7]))
                 for o, cs in (({}, TILE_RING_CASES), (dict(conv_units=5), TILE_RING_CASES[:2]),
                               (dict(conv_batch=2, regs=(40, 72, 200)), TILE_RING_CASES[:4]),
                               (dict(lazy_rescale=False), TILE_RING_CASES[:1])) for c in cs]
MOSAIC_CASES += [(*c[:6], dict(c[6], wide_scales=True), dict(F16_ASYM, **c[7])) for c in TILE_RING_CASES[:3]]
# the "owned" chunk order (session 69: a converting thread owns a row; static offsets, swapped store halves) with
# f16 and bf16 operands, the producer sharing the conversion, batches of two, the producer mode
MOSAIC_CASES += [(*c[:7], dict(fp8_chunk_order="owned", **o, **c[7]))
                 for o, cs in ((F16_ASYM, TILE_RING_CASES), (dict(consumers="asym", fp8_operands="bf16"),
                                                             TILE_RING_CASES),
                               (dict(F16_ASYM, conv_units=5), TILE_RING_CASES[:2]),
                               (dict(F16_ASYM, conv_batch=2), TILE_RING_CASES[:2]),
                               (dict(fp8_dequant="producer"), TILE_RING_CASES[:2])) for c in cs]
# the producer's staging copies as 1-D bulk copies (fp8_copy="bulk", session 70: all 13 passed on an H100; a
# "lanes" mode, a lane a row, faulted there and was removed) on every tile-ring case under the default consumers,
# with f16 + owned, the producer sharing the conversion, the producer mode, and the consumers' own conversion
MOSAIC_CASES += [(*c[:7], dict(fp8_copy=fc, **o, **c[7]))
                 for fc in ("bulk",)
                 for o, cs in (({}, TILE_RING_CASES), (dict(F16_ASYM, fp8_chunk_order="owned"), TILE_RING_CASES[:3]),
                               (dict(conv_units=5), TILE_RING_CASES[:2]), (dict(fp8_dequant="producer"),
                                                                           TILE_RING_CASES[:2]))
                 for c in cs]
# a quarter of P.V moved from the scorer to the helper (asym_scorer_cols=128, session 70): every tile-ring case on
# the default consumers, with f16 + owned + the lane copies, the producer sharing the conversion, the eager rescale
MOSAIC_CASES += [(*c[:7], dict(asym_scorer_cols=128, **o, **c[7]))
                 for o, cs in (({}, TILE_RING_CASES),
                               (dict(F16_ASYM, fp8_chunk_order="owned", fp8_copy="bulk"), TILE_RING_CASES[:3]),
                               (dict(conv_units=5), TILE_RING_CASES[:2]), (dict(lazy_rescale=False),
                                                                           TILE_RING_CASES[:1]))
                 for c in cs]
# ... and with q's first 256 columns in the scorer's registers (asym_q_regs, session 70), and 64 of them without
# the uneven split
MOSAIC_CASES += [(*c[:7], dict(asym_q_regs=qr, **o, **c[7]))
                 for qr, o, cs in ((256, dict(asym_scorer_cols=128), TILE_RING_CASES),
                                   (256, dict(F16_ASYM, fp8_chunk_order="owned", fp8_copy="bulk",
                                              asym_scorer_cols=128), TILE_RING_CASES[:3]),
                                   (64, {}, TILE_RING_CASES[:2]))
                 for c in cs]
MOSAIC_CASES += [(*c[:7], dict(fp8_copy=fc, fp8_dequant="consumers", **c[7]))
                 for fc in ("bulk",) for c in [
                     (4, 1, 128, 300, 128, 512, dict(fp8=True, ragged=True, dupes=True), {}),
                     (3, 2, 128, 600, 128, 1024, dict(all_invalid_c=True, ragged=True, fp8=True), dict(n_splits=3))]]


@pytest.mark.parametrize("case", MOSAIC_CASES,
                         ids=lambda c: f"b{c[0]}t{c[1]}k{c[5]}{'_fp8' if c[6].get('fp8') else ''}"
                                       f"{'_h%d' % c[6]['heads'] if 'heads' in c[6] else ''}{opts_id(c[7])}")
def test_gpu_mosaic_kernel(case):
    b, t, n_w, n_c, k_w, k_c, flags, opts = case
    flags = dict(flags)
    inp = make_inputs(b, t, flags.pop("heads", 64), 512, n_w, n_c, k_w, k_c, **flags)
    # fp8_pools="kernel": the FP8 prefill cases would otherwise be dequantized first (fp8_pools="auto", session 28)
    out = call(sparse_attention, inp, impl="pallas", kernel="mosaic", **{"fp8_pools": "kernel", **opts})
    check_close(out, call(sparse_attention_reference, inp))


@pytest.mark.parametrize("where", ["kv", "q"])
def test_gpu_mosaic_f16_operands_fail_loudly_past_f16s_range(where):
    """fp8_operands="f16": FP8 rows whose dequantized values pass 65504 (a scale byte of 2^9 with values up to
    ~2^17) or a q past it make inf / NaN rows, never a silently wrong finite output; the same inputs are finite with
    bf16 operands."""
    inp = make_inputs(2, 1, 64, 512, 300, 200, 128, 512, ragged=False)
    if where == "kv":
        inp["compressed_kv"] = (inp["compressed_kv"].astype(jnp.float32) * 2.0 ** 16).astype(jnp.bfloat16)
    else:
        inp["q"] = (inp["q"].astype(jnp.float32) * 2.0 ** 16).astype(jnp.bfloat16)
    from pallas_kernels.sparse_attention.fp8_layout import quantize_kv_fp8
    inp.update(window_kv=quantize_kv_fp8(inp["window_kv"]), compressed_kv=quantize_kv_fp8(inp["compressed_kv"]))
    f16 = np.asarray(call(sparse_attention, inp, impl="pallas", kernel="mosaic", **F16_ASYM)[0].astype(jnp.float32))
    bf16 = np.asarray(call(sparse_attention, inp, impl="pallas", kernel="mosaic",
                           **dict(F16_ASYM, fp8_operands="bf16"))[0].astype(jnp.float32))
    assert np.isfinite(bf16).all()
    assert not np.isfinite(f16).all()


FP8_POOL_CASES = [   # (b, t, heads, n_w, n_c, k_w, k_c, flags, kernel, fp8_pools): prefill-shaped, each pool row
    # gathered often; "auto" dequantizes first where the Mosaic kernel takes the bf16 pools
    (1, 256, 64, 2048, 1024, 128, 512, dict(dupes=True, ragged=True), "auto", "auto"),
    (2, 64, 128, 400, 100, 128, 96, dict(ragged=True), "mosaic", "auto"),
    (1, 256, 64, 2048, 1024, 128, 512, dict(all_invalid_c=True, wide_scales=True), "triton", "dequantize"),
    # an f32 q over the bf16 rows at head_dim 512 (3 Triton stages overflowed shared memory before session 28)
    (1, 64, 4, 300, 100, 128, 96, dict(ragged=True, q_dtype=jnp.float32), "triton", "dequantize"),
    (2, 8, 64, 300, 100, 128, 96, dict(ragged=True, q_dtype=jnp.float32), "auto", "dequantize"),
]


@pytest.mark.parametrize("case", FP8_POOL_CASES, ids=lambda c: f"b{c[0]}t{c[1]}h{c[2]}_{c[8]}_{c[9]}"
                         f"{'_f32' if 'q_dtype' in c[7] else ''}")
def test_gpu_fp8_pools_dequantized_first(case):
    """FP8 pools dequantized to bf16 once before the kernel (fp8_pools="auto" takes it for the Mosaic kernel's
    prefill shapes): the reference's result, and the kernel's on the pools dequantized by hand bit for bit (the
    same operands)."""
    from pallas_kernels.sparse_attention import dequantize_first, dequantize_kv_fp8

    b, t, h, n_w, n_c, k_w, k_c, flags, kernel, mode = case
    inp = make_inputs(b, t, h, 512, n_w, n_c, k_w, k_c, fp8=True, **flags)
    assert dequantize_first(inp["q"], inp["window_kv"], inp["window_idx"], inp["compressed_kv"],
                            inp["compressed_idx"], target="gpu", kernel=kernel, mode=mode)
    out = jax.jit(lambda i: call(sparse_attention, i, impl="pallas", kernel=kernel, fp8_pools=mode))(inp)
    ref = call(sparse_attention_reference, inp)
    check_close(out, ref)
    deq = dict(inp, window_kv=dequantize_kv_fp8(inp["window_kv"], jnp.bfloat16),
               compressed_kv=dequantize_kv_fp8(inp["compressed_kv"], jnp.bfloat16))
    bf16 = jax.jit(lambda i: call(sparse_attention, i, impl="pallas", kernel=kernel))(deq)
    np.testing.assert_array_equal(np.asarray(out[0].astype(jnp.float32)), np.asarray(bf16[0].astype(jnp.float32)))
    # the in-kernel dequantization on the same call agrees with both
    check_close(call(sparse_attention, inp, impl="pallas", kernel=kernel, fp8_pools="kernel"), ref)


@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_mosaic_window_only(fp8):
    """Sliding-only layers (compress_ratio 0 / 1) call the op with the window source alone: one source in the
    kernel's step sequence, through kernel="auto" (bf16 and FP8 pools both take the Mosaic kernel)."""
    inp = make_inputs(4, 1, 64, 512, 300, 64, 128, 64, fp8=fp8, ragged=True, dupes=True)
    inp.update(compressed_kv=None, compressed_idx=None, compressed_len=None)
    check_close(call(sparse_attention, inp, impl="pallas"), call(sparse_attention_reference, inp))


@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_mosaic_lengths_and_indices_as_given(fp8):
    """The Mosaic kernel takes the lists and lengths as given and cleans them itself (no XLA pass before it):
    negative lengths, lengths past K, indices past the pools' rows."""
    inp = make_inputs(3, 2, 64, 512, 300, 600, 128, 512, fp8=fp8, ragged=True, dupes=True)
    inp["window_len"] = inp["window_len"].at[0, 0].set(-5).at[1, 1].set(10 ** 6)
    inp["compressed_len"] = inp["compressed_len"].at[0, 1].set(-1).at[2, 0].set(513)
    inp["compressed_idx"] = inp["compressed_idx"].at[1, 0, :40].set(600 + 2 ** 20)
    out = call(sparse_attention, inp, impl="pallas", kernel="mosaic")
    check_close(out, call(sparse_attention_reference, inp))


def test_gpu_auto_picks_mosaic_only_where_it_applies():
    from pallas_kernels.sparse_attention import mosaic_applies

    inp = make_inputs(2, 1, 64, 512, 256, 1024, 128, 512)
    assert mosaic_applies(inp["q"], inp["window_kv"], inp["compressed_kv"])
    check_close(jax.jit(lambda i: call(sparse_attention, i, impl="auto"))(inp), call(sparse_attention_reference, inp))
    fp8 = make_inputs(2, 1, 64, 512, 256, 1024, 128, 512, fp8=True)
    assert mosaic_applies(fp8["q"], fp8["window_kv"], fp8["compressed_kv"])   # FP8 pools too (session 19)
    check_close(jax.jit(lambda i: call(sparse_attention, i, impl="auto"))(fp8), call(sparse_attention_reference, fp8))
    # a Mosaic-only knob with kernel="auto": the Mosaic kernel where it applies, a clear error where it does not
    check_close(call(sparse_attention, inp, impl="auto", cluster_loads="early", n_splits=2),
                call(sparse_attention_reference, inp))
    with pytest.raises(ValueError, match="does not apply to these inputs"):
        call(sparse_attention, inp, impl="auto", store_wait="read", out_dtype=jnp.float32)


def test_gpu_cluster_occupancy_query():
    """The driver's answer to how many (1, c, 1) clusters of one-per-SM CTAs fit at once: clusters of 1 are the SM
    count, and bigger clusters never fit more clusters. combine="auto" picks the in-kernel merge from it."""
    from pallas_kernels.sparse_attention.cluster_occupancy import max_active_clusters
    from pallas_kernels.sparse_attention.gpu_mosaic import _auto_combine

    caps = [max_active_clusters(c, 200 * 1024) for c in range(1, 9)]
    print("max active clusters of 1..8 CTAs (200 KB each):", caps)
    assert all(isinstance(x, int) and x > 0 for x in caps), caps
    assert caps[0] == jax.devices()[0].core_count, (caps[0], jax.devices()[0].core_count)
    assert all(a >= b for a, b in zip(caps, caps[1:])), caps
    assert _auto_combine(caps[1], 2, 200 * 1024, jnp.bfloat16) == "cluster"
    assert _auto_combine(caps[1] + 1, 2, 200 * 1024, jnp.bfloat16) == "xla"
    assert _auto_combine(4, 2, 200 * 1024, jnp.float32) == "xla"
