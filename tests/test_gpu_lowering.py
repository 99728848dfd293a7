"""Every Pallas GPU (Triton) kernel configuration lowers for CUDA — checked on CPU, no GPU needed.

The Pallas interpreter (the CPU kernel tests) runs any jnp primitive, but the Triton lowering supports only a
subset (e.g. no static `slice` of an in-register array): a kernel can pass every interpreted test and still fail to
compile on the GPU. `jit(...).trace(...).lower(lowering_platforms=("cuda",))` runs jax's Triton lowering (Python
side, down to Triton IR) for a CUDA target from a CPU-only machine, so those failures show up in CI. (Triton's own
compilation to PTX happens on the GPU only.)"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from test_compressor_kernels import make as make_compressor
from kernel_spies import spy_mosaic_builds
from tiers import core, full, full_tier, sweep
from test_indexer_kernels import make as make_indexer
from test_sparse_attention import make_inputs as make_attention


def lowers_for(platform, marker, fn, *args):
    """jit(fn) lowers for `platform` from this (CPU) machine, and the module holds a kernel (`marker` in its text);
    returns the module's text, lower-cased."""
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text().lower()
    assert marker in text, f"no {marker} kernel in the module lowered for {platform}"
    return text


def lowers_for_cuda(fn, *args):
    lowers_for("cuda", "triton", fn, *args)


@pytest.mark.parametrize("fmt,rotate", [(None, False), ("bf16", False), ("fp8", True), ("fp4", True)])
@pytest.mark.parametrize("S,opts", [(1, {}), full(19, {}), full(1, dict(fp4_scale="reshape", block_t=32, num_splits=3)),
                                    full(1, dict(precision="bf16")), full(1, dict(topk="radix")),
                                    full(1, dict(topk="radix4")), full(1, dict(heads_major=True))])
def test_indexer_lowers(fmt, rotate, S, opts):
    from pallas_kernels.indexer.gpu import indexer_topk_gpu

    q, w, keys, nv = make_indexer(2, S, 64, 300, fmt, rotate, causal=S > 1)
    lowers_for_cuda(lambda q, w, k, n: indexer_topk_gpu(q, w, k, n, k=64, **opts), q, w, keys, nv)


@pytest.mark.parametrize("fmt", [None, "bf16", "fp8", full("fp4")])
def test_indexer_decode_wide_blocks_lower(fmt):
    """Decode over T >= 2048 keys: the 256-key x 8-warp default (f32 keys keep 64 x 4)."""
    from pallas_kernels.indexer.gpu import indexer_topk_gpu

    q, w, keys, nv = make_indexer(2, 1, 64, 5000, fmt, fmt == "fp4")
    lowers_for_cuda(lambda q, w, k, n: indexer_topk_gpu(q, w, k, n, k=512), q, w, keys, nv)


@pytest.mark.parametrize("fmt,topk", [full("bf16", "threshold"), ("bf16", "threshold_set"),
                                      full("fp8", "threshold_select")])
def test_indexer_fused_group_maxima_lower(fmt, topk):
    """Decode over a 32768-key cache with few splits: the scores kernel carries the top-k's 1024 strided-group
    maxima (4 phases of 256-key blocks over bf16 keys, 16 of 64 over fp8) and writes them (kernel name ..._g1024)."""
    from pallas_kernels.indexer.gpu import indexer_topk_gpu

    q, w, keys, nv = make_indexer(2, 1, 64, 32768, fmt, fmt == "fp8")
    fused = lambda q, w, k, n: indexer_topk_gpu(q, w, k, n, k=512, topk=topk, num_splits=8, fuse_group_max=True)
    lowers_for("cuda", "_g1024", fused, q, w, keys, nv)


@pytest.mark.parametrize("T,marker,absent,tour_max,segment", [(4096, "topk_hist", "_g1024", None, True),
                                                              full(65536, "topk_hist_segments", "_g1024", None, False),
                                                              full(65536, "_g1024", "topk_hist", 0, False),
                                                              full(65536, "_sel512", "_g1024", None, True)])
def test_indexer_auto_set_lowers(T, marker, absent, tour_max, segment, monkeypatch):
    """topk="auto_set" (the model's set picks on the GPU) at 16 decode rows: the histogram top-k kernel at 4096 keys
    (and no group maxima from the Mosaic scores kernel); at 65536 the segment top-k inside the scores kernel
    (..._sel512, since session 58), and with it off (`gpu.AUTO_SEGMENT`) the tournament (segment programs, no maxima),
    or the chain with the maxima (..._g1024) where the tournament's limit is lowered below the call's size."""
    from pallas_kernels.indexer import gpu
    from pallas_kernels.indexer.gpu import indexer_topk_gpu

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")    # the GPU's top-k impls, not XLA's
    monkeypatch.setattr(gpu, "AUTO_SEGMENT", segment)
    if tour_max is not None:
        monkeypatch.setattr(gpu, "AUTO_SET_TOUR_MAX", tour_max)
    q, w, keys, nv = make_indexer(16, 1, 64, T, "fp8", False)
    fn = lambda q, w, k, n: indexer_topk_gpu(q, w, k, n, k=512, topk="auto_set")
    assert absent not in lowers_for("cuda", marker, fn, q, w, keys, nv)


def test_indexer_fp4_bf16_operands_lower():
    """fp4 keys with bf16 operands (an option since f16 became the default), both scale broadcasts."""
    from pallas_kernels.indexer.gpu import indexer_topk_gpu

    q, w, keys, nv = make_indexer(2, 1, 64, 300, "fp4", True)
    for fp4_scale in ("gather", "reshape"):
        lowers_for_cuda(lambda q, w, k, n: indexer_topk_gpu(q, w, k, n, k=64, precision="bf16", fp4_scale=fp4_scale),
                        q, w, keys, nv)


@full_tier
@pytest.mark.parametrize("S", [1, 19])
def test_indexer_fp4_asm_decode_lowers(S):
    """fp4 keys decoded by the packed inline PTX (fp4_decode="asm", the compiled default for fp4 / f16) lower."""
    from pallas_kernels.indexer.gpu import default_config, default_fp4_decode, indexer_topk_gpu

    q, w, keys, nv = make_indexer(2, S, 64, 3000, "fp4", True, causal=S > 1)
    lowers_for("cuda", "triton", lambda q, w, k, n: indexer_topk_gpu(q, w, k, n, k=64, fp4_decode="asm"),
               q, w, keys, nv)
    cfg = default_config(S, 3000, q_bytes=64 * 64 * 2, key_bytes=0.5)   # the default picks asm for these shapes
    assert default_fp4_decode("fp4", "f16", cfg["block_t"], cfg["num_warps"], interpret=False) == "asm"
    assert default_fp4_decode("fp4", "f16", cfg["block_t"], cfg["num_warps"], interpret=True) == "alu"
    assert default_fp4_decode("fp8", "f16", cfg["block_t"], cfg["num_warps"], interpret=False) == "alu"
    assert default_fp4_decode("fp4", "f16", 16, 4, interpret=False) == "alu"
    from pallas_kernels.indexer.gpu import default_fp4_scale_at   # the scales ride on the operands where they can
    assert [default_fp4_scale_at(f, p) for f, p in [("fp4", "f16"), ("fp4", "fp8"), ("fp4", "bf16"), ("fp8", "f16")]] \
        == ["operand", "result", "result", "result"]


@full_tier
@pytest.mark.parametrize("S,decode", [(1, "asm"), (19, "asm"), (1, "alu")])
def test_indexer_fp4_scales_on_operands_lower(S, decode):
    """fp4_scale_at="operand": the group scales on the f16 key operands (either nibble decode)."""
    from pallas_kernels.indexer.gpu import indexer_topk_gpu

    q, w, keys, nv = make_indexer(2, S, 64, 3000, "fp4", True, causal=S > 1)
    lowers_for_cuda(lambda q, w, k, n: indexer_topk_gpu(q, w, k, n, k=64, fp4_decode=decode, fp4_scale_at="operand"),
                    q, w, keys, nv)


@pytest.mark.parametrize("precision", ["f16", "fp8"])
@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_indexer_f16_and_fp8_operands_lower(fmt, precision):
    from pallas_kernels.indexer.gpu import indexer_topk_gpu

    q, w, keys, nv = make_indexer(2, 1, 64, 300, fmt, True)
    lowers_for_cuda(lambda q, w, k, n: indexer_topk_gpu(q, w, k, n, k=64, precision=precision), q, w, keys, nv)


def test_topk_compact_kernel_lowers():
    """The threshold top-k's Triton compaction kernel (topk="threshold" on a GPU)."""
    from pallas_kernels.indexer.topk import topk_threshold

    s = jax.random.normal(jax.random.key(0), (3, 40000), jnp.float32)
    lowers_for_cuda(lambda x: topk_threshold(x, 512, impl="pallas"), s)
    lowers_for_cuda(lambda x: topk_threshold(x, 512, impl="pallas_compact"), s)
    lowers_for_cuda(lambda x: topk_threshold(x, 512, impl="pallas_select"), s)           # bound + select kernels
    lowers_for_cuda(lambda x: topk_threshold(x, 512, impl="pallas_select", sorted=False), s)
    lowers_for_cuda(lambda x: topk_threshold(x, 512, impl="pallas_fused", sorted=False), s)   # one kernel a row
    lowers_for_cuda(lambda x: topk_threshold(x, 512, impl="pallas_regions", sorted=False), s)  # two kernels


@full_tier
def test_topk_radix_count_matrix_lowers(monkeypatch):
    """The bound / select kernels with all digit counts of a pass as one [N, 2**bits] reduction, and the fused
    kernel with both count modes and 4-bit digits."""
    from pallas_kernels.indexer import topk as T_
    from pallas_kernels.indexer.topk_fused import fused_select

    s = jax.random.normal(jax.random.key(0), (3, 40000), jnp.float32)
    monkeypatch.setitem(T_.SELECT_KERNEL_CONFIG, "bound_matrix", True)
    monkeypatch.setitem(T_.SELECT_KERNEL_CONFIG, "select_matrix", True)
    lowers_for_cuda(lambda x: T_.topk_threshold(x, 512, impl="pallas_select", sorted=False), s)
    lowers_for_cuda(lambda x: fused_select(x, 512, matrix=False, bound_bits=4, rows_per_step=1, num_warps=16), s)
    monkeypatch.setitem(T_.SELECT_KERNEL_CONFIG, "early_exit", True)        # the dynamic pass loop
    lowers_for_cuda(lambda x: T_.topk_threshold(x, 512, impl="pallas_select", sorted=False), s)
    lowers_for_cuda(lambda x: fused_select(x, 512, early_exit=True, num_stages=3, stop_after=3), s)
    lowers_for_cuda(lambda x: fused_select(x[:, :32768], 512, resident=True, num_warps=32), s)


@pytest.mark.parametrize("flags,opts", [
    (dict(fp8=False, ragged=True), {}),
    full(dict(fp8=True, ragged=True, dupes=True), dict(n_splits=3)),
    full(dict(fp8=True, ragged=True), dict(n_splits=3, fp8_scales="vector", partial_dtype=jnp.bfloat16)),
    (dict(fp8=False, q_dtype=jnp.float32), dict(n_splits=1)),
    full(dict(fp8=True, ragged=True), dict(n_splits=2, d_chunk=128, fp8_operands="f16")),
    full(dict(fp8=False, ragged=True), dict(n_splits=1, col_splits=2)),
    full(dict(fp8=True, ragged=True), dict(n_splits=2, col_splits=2)),
    full(dict(fp8=False, ragged=True), dict(n_splits=2, prefetch="idx")),
    full(dict(fp8=True, ragged=True), dict(n_splits=2, prefetch="rows")),
])
def test_sparse_attention_lowers(flags, opts):
    from pallas_kernels.sparse_attention.gpu import sparse_attention_gpu

    inp = make_attention(2, 1, 64, 512, 300, 200, 128, 64, **flags)
    keys = ("q", "window_kv", "window_idx", "compressed_kv", "compressed_idx", "sinks")
    lens = dict(window_len=inp["window_len"], compressed_len=inp["compressed_len"])
    lowers_for_cuda(lambda *a: sparse_attention_gpu(*a, scale=512 ** -0.5, **lens, **opts), *(inp[k] for k in keys))


@pytest.mark.parametrize("r,overlap,d,fmt,rotate,S", [
    full(4, True, 128, "fp4", True, 1), (4, True, 128, "fp8", True, 33), full(4, True, 128, "bf16", False, 9),
    (4, True, 512, None, False, 40), full(128, False, 512, None, False, 300), (128, False, 512, None, False, 1),
    (4, True, 512, "kv_fp8", False, 40)])
def test_compressor_lowers(r, overlap, d, fmt, rotate, S):
    from pallas_kernels.compressor.gpu import compress_chunk_gpu

    entries_fmt = None if fmt == "kv_fp8" else fmt
    inp, kw = make_compressor(2, S, r, overlap, d, entries_fmt)
    if fmt == "kv_fp8":
        from pallas_kernels.sparse_attention.fp8_layout import quantize_kv_fp8_rows

        inp["entries"] = quantize_kv_fp8_rows(inp["entries"])
        kw["key_format"] = "kv_fp8"
    keys = ("kv", "gate", "start", "n_valid", "state_kv", "state_gate", "prev_kv", "prev_gate", "entries")
    lowers_for_cuda(lambda *a: compress_chunk_gpu(*a, **kw, rotate=rotate), *(inp[k] for k in keys))


@full_tier
@pytest.mark.parametrize("quantized", [False, True])
def test_whole_model_lowers_with_gpu_kernels(monkeypatch, quantized):
    """prefill + decode of a tiny model (sliding, CSA, HCA layers) with every attention op on its GPU kernel."""
    from flax import nnx

    import pallas_kernels.dispatch as dispatch
    from dsv4_jax.config import tiny
    from dsv4_jax.model import DeepseekV4ForCausalLM

    monkeypatch.setattr(dispatch.jax, "default_backend", lambda: "gpu")   # dispatchers resolve "pallas" -> gpu
    cfg = tiny(head_dim=512, qk_rope_head_dim=64, index_head_dim=64) if quantized else tiny()
    model = DeepseekV4ForCausalLM(cfg, rngs=nnx.Rngs(0), attention_impl="pallas",
                                  indexer_picks="set" if quantized else "sorted")
    fmt = dict(kv_dtype="fp8", indexer_dtype="fp4", indexer_rotate=True) if quantized else {}
    lower_model_steps(model, model.init_cache(2, 24, **fmt), "triton")


def lower_model_steps(model, cache, marker):
    """A prefill chunk (9 tokens) and a decode step of `model` lower for CUDA with a `marker` kernel in them."""
    import numpy as np
    from flax import nnx

    from dsv4_jax.model import forward_chunk

    graphdef, state = nnx.split(model)
    step = lambda st, ids, c, n: forward_chunk(nnx.merge(graphdef, st), ids, c, n)
    for S in (9, 1):
        ids = jnp.asarray(np.random.default_rng(S).integers(0, model.config.vocab_size, (2, S)), jnp.int32)
        lowers_for("cuda", marker, step, state, ids, cache, jnp.full((2,), S, jnp.int32))


# the default tier lowers each default shape (decode, streamed long lists, prefill; bf16 and FP8), 128 heads, the
# cluster merge and the streamed FP8 ring; the full tier every knob
@pytest.mark.parametrize("b,t,k_c,opts,fp8", sweep([core(3, 1, 512, {}, False), (2, 1, 1024, dict(n_splits=1), False),
                                              core(1, 64, 60, {}, False), core(2, 1, 8192, {}, False),
                                              core(3, 1, 512, {}, True),
                                              (2, 1, 8192, dict(n_splits=3), True), core(1, 64, 60, {}, True),
                                              (3, 1, 512, dict(regs=(40, 232)), False),
                                              (1, 64, 60, dict(regs=(24, 240)), True),
                                              (3, 1, 512, dict(_diag="loop"), True),
                                              core(3, 1, 512, dict(heads=128), False),
                                              (2, 1, 1024, dict(heads=128, n_splits=2), True),
                                              (3, 1, 512, dict(split_scores=True), False),
                                              (1, 64, 60, dict(split_scores=True, heads=128), False),
                                              (3, 1, 512, dict(split_scores=True, heads=128), False),
                                              (2, 1, 8192, dict(split_scores=True, _diag="ss_tail"), False),
                                              (3, 1, 512, dict(split_scores=True, _diag="ss_noexchange"), False),
                                              (3, 1, 512, dict(producer="cp_async"), False),
                                              (2, 1, 8192, dict(producer="cp_async", heads=128), False),
                                              (1, 64, 60, dict(producer="cp_async", split_scores=True), False),
                                              (3, 1, 512, dict(l2_ahead=2), False),
                                              (2, 1, 8192, dict(l2_ahead=4, n_splits=3), True),
                                              (1, 64, 60, dict(l2_ahead=1, producer="cp_async"), False),
                                              (3, 1, 512, dict(block_k=32, num_stages=4), False),
                                              (2, 1, 1024, dict(block_k=32, num_stages=4, heads=128), False),
                                              (1, 64, 60, dict(block_k=32, num_stages=4, split_scores=True), False),
                                              (2, 1, 8192, dict(block_k=32, num_stages=4, n_splits=3), False),
                                              (2, 1, 8192, dict(n_splits=3, combine="pallas"), False),
                                              (2, 1, 1024, dict(n_splits=2, combine="pallas", heads=128), True),
                                              (2, 1, 8192, dict(n_splits=3, combine="cluster"), False),
                                              core(2, 1, 8192, dict(combine="cluster"), False),
                                              (2, 1, 1024, dict(n_splits=2, combine="cluster", heads=128), True),
                                              (3, 1, 512, dict(combine="cluster", block_k=32, num_stages=4), False),
                                              (1, 64, 60, dict(store_wait="read"), True),
                                              (2, 1, 8192, dict(store_wait="write", combine="cluster"), False),
                                              (3, 1, 512, dict(idx_first=True), True),
                                              (1, 64, 60, dict(idx_first=False, store_wait="write"), False),
                                              (3, 1, 512, dict(pingpong=True), False),
                                              (2, 1, 8192, dict(pingpong=True, combine="cluster"), False),
                                              (1, 64, 60, dict(pingpong=True, split_scores=False), False),
                                              (2, 1, 1024, dict(pingpong=True, n_splits=2, heads=128), False),
                                              (2, 1, 8192, dict(combine="cluster", cluster_loads="early"), False),
                                              (2, 1, 8192, dict(n_splits=3, combine="cluster", cluster_loads="early"),
                                               False),
                                              (2, 1, 8192, dict(n_splits=5, combine="cluster", cluster_loads="early"),
                                               True),
                                              (2, 1, 1024, dict(n_splits=2, combine="cluster", heads=128,
                                                                cluster_loads="early"), True),
                                              (3, 1, 512, dict(combine="cluster", block_k=32, num_stages=4,
                                                               cluster_loads="early"), False),
                                              (3, 1, 512, dict(split_d=True), False),
                                              (3, 1, 512, dict(split_d=True, n_splits=1), False),
                                              (2, 1, 8192, dict(split_d=True, combine="xla"), False),
                                              (1, 64, 60, dict(split_d=True, heads=128), False),
                                              (3, 1, 512, dict(split_d=True, block_k=32, num_stages=4), False),
                                              (3, 1, 512, dict(fp8_convert="rebias"), True),
                                              (3, 1, 512, dict(num_stages=2), True),
                                              (3, 1, 512, dict(fp8_overlap=True), True),
                                              (2, 1, 8192, dict(fp8_overlap=True, fp8_convert="rebias",
                                                                n_splits=3, combine="xla"), True),
                                              (1, 64, 60, dict(fp8_overlap=True, heads=128), True),
                                              (3, 1, 512, dict(_diag="dequant_both", split_d=True, num_stages=1), True),
                                              (1, 64, 60, dict(_diag="loop", split_d=False), True),
                                              (2, 1, 8192, dict(fp8_convert="rebias", split_d=True, num_stages=1),
                                               True),
                                              # the producer dequantizes into a ring of 32-row bf16 tiles
                                              (3, 1, 512, dict(fp8_dequant="producer"), True),
                                              (2, 1, 8192, dict(fp8_dequant="producer", n_splits=3, combine="xla"),
                                               True),
                                              (1, 64, 60, dict(fp8_dequant="producer", heads=128), True),
                                              (3, 1, 512, dict(fp8_dequant="producer", fp8_convert="cvt",
                                                               num_stages=2), True),
                                              (1, 64, 60, dict(fp8_dequant="producer", num_stages=4), True),
                                              # a fourth warpgroup converts (512 threads per CTA)
                                              (3, 1, 512, dict(fp8_dequant="converter"), True),
                                              (3, 1, 512, dict(fp8_dequant="converter", combine="cluster",
                                                               n_splits=4), True),
                                              (2, 1, 8192, dict(fp8_dequant="converter", n_splits=3, combine="xla"),
                                               True),
                                              (1, 64, 60, dict(fp8_dequant="converter", heads=128), True),
                                              (1, 64, 60, dict(fp8_dequant="converter", num_stages=2,
                                                               regs=(24, 64, 208)), True),
                                              # ... and shares each step's conversion with the producer
                                              (3, 1, 512, dict(fp8_dequant="converter", conv_units=5), True),
                                              # ... converting without conversion instructions (session 67)
                                              (3, 1, 512, dict(fp8_dequant="converter", _diag="bits"), True),
                                              # the diagonal chunk order, each conversion path
                                              (3, 1, 512, dict(fp8_chunk_order="diagonal"), True),
                                              (1, 64, 60, dict(fp8_chunk_order="diagonal", num_stages=2), True),
                                              (3, 1, 512, dict(fp8_chunk_order="diagonal", fp8_overlap=True), True),
                                              (3, 1, 512, dict(fp8_chunk_order="diagonal", fp8_dequant="producer"),
                                               True),
                                              (2, 1, 8192, dict(fp8_chunk_order="diagonal", fp8_dequant="converter",
                                                                conv_units=5), True),
                                              # a third bf16 tile next to two staging slots
                                              (3, 1, 512, dict(fp8_dequant="converter", tile_slots=3, num_stages=2),
                                               True),
                                              (1, 64, 60, dict(fp8_dequant="converter", conv_units=5, tile_slots=3,
                                                               num_stages=2), True),
                                              (3, 1, 512, dict(fp8_dequant="producer", tile_slots=3, num_stages=2),
                                               True),
                                              (2, 1, 8192, dict(fp8_dequant="converter", conv_units=7, n_splits=3,
                                                               combine="cluster"), True),
                                              (1, 64, 60, dict(fp8_dequant="converter", conv_units=1, heads=128,
                                                               num_stages=2), True),
                                              # batches of chunks loaded before their stores
                                              (3, 1, 512, dict(conv_batch=3), True),
                                              (1, 64, 60, dict(conv_batch=9, tile_slots=3, num_stages=2), True),
                                              (2, 1, 8192, dict(fp8_dequant="converter", conv_units=5,
                                                                conv_batch=2), True),
                                              (3, 1, 512, dict(fp8_dequant="producer", conv_batch=4), True),
                                              # the lazy rescale of the output accumulator
                                              (3, 1, 512, dict(lazy_rescale=True), False),
                                              (2, 1, 8192, dict(lazy_rescale=True, n_splits=3, combine="xla"),
                                               False),
                                              (1, 64, 60, dict(lazy_rescale=True, split_scores=False), False),
                                              (3, 1, 512, dict(lazy_rescale=True), True),
                                              (1, 64, 60, dict(lazy_rescale=True, conv_batch=3), True),
                                              (3, 1, 512, dict(lazy_rescale=True, fp8_dequant="consumers"), True),
                                              # index rows streamed through a ring (idx_stream), each producer mode
                                              (2, 1, 8192, dict(idx_stream=True, n_splits=2), False),
                                              (1, 64, 60, dict(idx_stream=True, split_scores=True), False),
                                              (3, 1, 512, dict(idx_stream=True, pingpong=True), False),
                                              (2, 1, 8192, dict(idx_stream=True, heads=128, n_splits=1), False),
                                              core(2, 1, 8192, dict(idx_stream=True, n_splits=2), True),
                                              (2, 1, 8192, dict(idx_stream=True, fp8_dequant="consumers"), True),
                                              (2, 1, 8192, dict(idx_stream=True, fp8_dequant="producer"), True),
                                              (1, 64, 60, dict(idx_stream=True), True),
                                              # the producer loads FP8 rows into registers (no staging)
                                              core(3, 1, 512, dict(fp8_dequant="direct"), True),
                                              (2, 1, 8192, dict(fp8_dequant="direct", n_splits=3, combine="xla"),
                                               True),
                                              (1, 64, 60, dict(fp8_dequant="direct", heads=128, conv_batch=1,
                                                               direct_staging="registers"), True),
                                              (3, 1, 512, dict(fp8_dequant="direct", direct_staging="registers"),
                                               True),
                                              (3, 1, 512, dict(fp8_dequant="direct", block_k=32), True),
                                              (2, 1, 8192, dict(fp8_dequant="direct", idx_stream=True), True),
                                              (2, 1, 8192, dict(fp8_dequant="direct", idx_stream=True,
                                                                direct_prefetch=True), True),
                                              (3, 1, 512, dict(fp8_dequant="direct", direct_prefetch=True), True),
                                              (3, 1, 512, dict(fp8_dequant="direct", direct_prefetch=False), True),
                                              # the ring's full barriers per piece of d (bf16, split_d)
                                              core(3, 1, 512, dict(piece_barriers=True), False),
                                              (2, 1, 8192, dict(piece_barriers=True, idx_stream=True, n_splits=2),
                                               False),
                                              (2, 1, 8192, dict(piece_barriers=True, n_splits=3, combine="xla"),
                                               False),
                                              (1, 64, 60, dict(piece_barriers=True, heads=128), False),
                                              (3, 1, 512, dict(piece_barriers=True, num_stages=1), False),
                                              core(3, 1, 512, dict(piece_barriers="pieces"), False),
                                              (2, 1, 8192, dict(piece_barriers="pieces", idx_stream=True,
                                                                n_splits=2), False),
                                              (1, 64, 60, dict(piece_barriers="pieces", heads=128), False),
                                              # the next step's scores in flight under the softmax (score_ahead)
                                              core(3, 1, 512, dict(score_ahead=True), True),
                                              (2, 1, 8192, dict(score_ahead=True, idx_stream=True, n_splits=2),
                                               True),
                                              (1, 64, 60, dict(score_ahead=True, conv_units=5, heads=128), True),
                                              core(3, 1, 512, dict(score_ahead=True, block_k=32, num_stages=4),
                                                   False),
                                              (1, 64, 60, dict(score_ahead=True), False),
                                              # FlashMLA's consumer split: one consumer scores, the other runs P.V
                                              core(3, 1, 512, dict(consumers="asym"), False),
                                              (2, 1, 8192, dict(consumers="asym", idx_stream=True, n_splits=2),
                                               False),
                                              (2, 1, 8192, dict(consumers="asym", n_splits=3, combine="xla"), False),
                                              (1, 64, 60, dict(consumers="asym", heads=128), False),
                                              (3, 1, 512, dict(consumers="asym", lazy_rescale=True, num_stages=1),
                                               False),
                                              # ... over the producer's direct FP8 gather (FlashMLA's FP8 shape)
                                              core(3, 1, 512, dict(consumers="asym", fp8_dequant="direct"), True),
                                              (2, 1, 8192, dict(consumers="asym", fp8_dequant="direct",
                                                                idx_stream=True, n_splits=2), True),
                                              (1, 64, 60, dict(consumers="asym", fp8_dequant="direct", heads=128),
                                               True),
                                              (3, 1, 512, dict(consumers="asym", fp8_dequant="direct",
                                                               direct_staging="registers"), True),
                                              # ... over the converter warpgroup's 32-row tiles (session 67)
                                              core(3, 1, 512, dict(consumers="asym", fp8_dequant="converter"), True),
                                              (2, 1, 8192, dict(consumers="asym", fp8_dequant="converter",
                                                                n_splits=3, combine="xla"), True),
                                              (1, 64, 60, dict(consumers="asym", fp8_dequant="converter", heads=128),
                                               True),
                                              (2, 1, 8192, dict(consumers="asym", fp8_dequant="converter",
                                                                idx_stream=True, n_splits=2, conv_units=5), True),
                                              # ... with its conversion diagnostics (session 68)
                                              (3, 1, 512, dict(consumers="asym", _diag="no_convert"), True),
                                              (1, 64, 60, dict(consumers="asym", _diag="bits", conv_units=7), True),
                                              # ... with f16 operands (session 69)
                                              core(3, 1, 512, dict(fp8_operands="f16"), True),
                                              (2, 1, 8192, dict(fp8_operands="f16", n_splits=3, combine="xla"), True),
                                              (1, 64, 60, dict(fp8_operands="f16", heads=128), True),
                                              (2, 1, 8192, dict(fp8_operands="f16", idx_stream=True, n_splits=2,
                                                                conv_units=5), True),
                                              (3, 1, 512, dict(fp8_operands="f16", conv_batch=2, regs=(40, 72, 200)),
                                               True),
                                              (3, 1, 512, dict(fp8_operands="f16", _diag="no_q_convert"), True),
                                              (3, 1, 512, dict(fp8_operands="f16", _diag="no_convert"), True),
                                              # ... and the "owned" chunk order
                                              core(3, 1, 512, dict(fp8_operands="f16", fp8_chunk_order="owned"),
                                                   True),
                                              (2, 1, 8192, dict(fp8_chunk_order="owned", conv_units=5, n_splits=2),
                                               True),
                                              (3, 1, 512, dict(fp8_chunk_order="owned", fp8_dequant="producer"),
                                               True),
                                              # ... the producer's staging copies as 1-D bulk copies (session 70)
                                              core(3, 1, 512, dict(fp8_copy="bulk"), True),
                                              (2, 1, 8192, dict(fp8_copy="bulk", idx_stream=True, n_splits=2,
                                                                conv_units=5), True),
                                              (3, 1, 512, dict(fp8_copy="bulk", fp8_operands="f16",
                                                               fp8_chunk_order="owned"), True),
                                              (3, 1, 512, dict(fp8_copy="bulk", fp8_dequant="consumers"), True),
                                              (3, 1, 512, dict(fp8_copy="bulk", fp8_dequant="producer"), True),
                                              (1, 64, 60, dict(fp8_copy="bulk", heads=128), True),
                                              # ... a quarter of P.V moved to the helper (session 70)
                                              core(3, 1, 512, dict(asym_scorer_cols=128), True),
                                              (2, 1, 8192, dict(asym_scorer_cols=128, n_splits=3, combine="xla"),
                                               True),
                                              (1, 64, 60, dict(asym_scorer_cols=128, heads=128), True),
                                              (2, 1, 8192, dict(asym_scorer_cols=128, idx_stream=True, n_splits=2,
                                                                conv_units=5), True),
                                              (3, 1, 512, dict(asym_scorer_cols=128, fp8_operands="f16",
                                                               fp8_chunk_order="owned", fp8_copy="bulk"), True),
                                              (3, 1, 512, dict(asym_scorer_cols=128, lazy_rescale=False,
                                                               regs=(40, 56, 176, 240)), True),
                                              # ... q's first columns in the scorer's registers (session 70)
                                              core(3, 1, 512, dict(asym_scorer_cols=128, asym_q_regs=256), True),
                                              (2, 1, 8192, dict(asym_scorer_cols=128, asym_q_regs=256, n_splits=3,
                                                                combine="xla"), True),
                                              (1, 64, 60, dict(asym_scorer_cols=128, asym_q_regs=256, heads=128),
                                               True),
                                              (3, 1, 512, dict(asym_scorer_cols=128, asym_q_regs=256,
                                                               fp8_operands="f16", fp8_chunk_order="owned",
                                                               fp8_copy="bulk"), True),
                                              (3, 1, 512, dict(asym_q_regs=64), True),
                                              # ... a third tile slot on the defaults, the converter at 64 (s72)
                                              (3, 1, 512, dict(tile_slots=3, num_stages=2, regs=(40, 64, 184, 224)),
                                               True),
                                              (3, 1, 512, dict(asym_q_regs=512, asym_scorer_cols=128), True)]))
def test_sparse_attention_mosaic_lowers(b, t, k_c, opts, fp8):
    from pallas_kernels.sparse_attention.gpu_mosaic import sparse_attention_mosaic

    opts = dict(opts)
    inp = make_attention(b, t, opts.pop("heads", 64), 512, 300, 9000, 128, k_c, ragged=True, fp8=fp8)
    keys = ("q", "window_kv", "window_idx", "compressed_kv", "compressed_idx", "sinks")
    lens = dict(window_len=inp["window_len"], compressed_len=inp["compressed_len"])
    lowers_for("cuda", "mosaic_gpu", lambda *a: sparse_attention_mosaic(*a, scale=512 ** -0.5, **lens, **opts),
               *(inp[k] for k in keys))


def test_sparse_attention_cluster_combine_rejects_what_it_cannot_do():
    """combine='cluster' merges in the kernel: at most 8 splits (one cluster), bf16 output, the Mosaic kernel only;
    with combine=None and an f32 output the Mosaic kernel resolves to the XLA merge."""
    from pallas_kernels.sparse_attention.gpu import sparse_attention_gpu
    from pallas_kernels.sparse_attention.gpu_mosaic import resolve_combine, sparse_attention_mosaic

    inp = make_attention(2, 1, 64, 512, 300, 9000, 128, 8192, ragged=True, fp8=False)
    args = [inp[k] for k in ("q", "window_kv", "window_idx", "compressed_kv", "compressed_idx", "sinks")]
    kw = dict(scale=512 ** -0.5, window_len=inp["window_len"], compressed_len=inp["compressed_len"])
    with pytest.raises(ValueError, match="n_splits <= 8"):
        jax.jit(lambda *a: sparse_attention_mosaic(*a, **kw, n_splits=9, combine="cluster")).lower(*args)
    with pytest.raises(ValueError, match="bf16"):
        jax.jit(lambda *a: sparse_attention_mosaic(*a, **kw, combine="cluster", out_dtype=jnp.float32)).lower(*args)
    with pytest.raises(ValueError, match="Mosaic GPU kernel's"):
        sparse_attention_gpu(*args, **kw, combine="cluster", interpret=True)
    with pytest.raises(ValueError, match="cluster_loads"):
        jax.jit(lambda *a: sparse_attention_mosaic(*a, **kw, combine="cluster", cluster_loads="late")).lower(*args)
    assert resolve_combine("cluster", jnp.bfloat16) == "cluster"
    assert resolve_combine("pallas", jnp.float32) == "pallas"


def test_sparse_attention_mosaic_asym_consumers_reject_what_they_cannot_do(monkeypatch):
    """consumers="asym" (one consumer scores, the other runs P.V from the first's P in shared memory) runs 64-row
    steps of bf16 rings from the bulk-copy producer in 1-4 slots (a named barrier each), or FP8 pools through a
    named tile ring (fp8_dequant="direct", 64-row steps, or "converter", 32-row), and none of the pair's own
    schedules; where it applies the wrapper builds it with split_d, split_scores and pingpong off."""
    from pallas_kernels.sparse_attention.gpu_mosaic import sparse_attention_mosaic

    keys = ("q", "window_kv", "window_idx", "compressed_kv", "compressed_idx", "sinks")
    bf16 = make_attention(2, 1, 64, 512, 300, 9000, 128, 512, ragged=True, fp8=False)
    fp8 = make_attention(2, 1, 64, 512, 300, 9000, 128, 512, ragged=True, fp8=True)
    with pytest.raises(ValueError, match="consumers must be"):
        sparse_attention_mosaic(*(bf16[k] for k in keys), scale=0.1, consumers="seesaw")
    for dequant in ("producer", "consumers"):   # FP8 pools: only through the direct or converter tile ring
        with pytest.raises(ValueError, match="FP8 pools with fp8_dequant"):
            sparse_attention_mosaic(*(fp8[k] for k in keys), scale=0.1, consumers="asym", fp8_dequant=dequant)
    with pytest.raises(ValueError, match="default tile ring .* takes regs as"):   # rules the default converter out
        sparse_attention_mosaic(*(fp8[k] for k in keys), scale=0.1, consumers="asym", regs=(40, 232))
    with pytest.raises(ValueError, match="fp8_overlap or _diag"):   # the consumers' own conversion diagnostics
        sparse_attention_mosaic(*(fp8[k] for k in keys), scale=0.1, consumers="asym", _diag="loop")
    with pytest.raises(ValueError, match="takes block_k=32"):   # the converter's tiles are 32 rows
        sparse_attention_mosaic(*(fp8[k] for k in keys), scale=0.1, consumers="asym", fp8_dequant="converter",
                                block_k=64)
    for opts, match in [(dict(split_d=True), "split_d"), (dict(split_scores=True), "split_scores"),
                        (dict(pingpong=True), "pingpong"), (dict(piece_barriers=True), "piece_barriers"),
                        (dict(score_ahead=True), "score_ahead"), (dict(block_k=32), "block_k=32"),
                        (dict(block_k=128), "block_k=128"), (dict(producer="cp_async"), "cp_async"),
                        (dict(num_stages=5), "1-4 ring slots")]:
        with pytest.raises(ValueError, match=match):
            sparse_attention_mosaic(*(bf16[k] for k in keys), scale=0.1, consumers="asym", **opts)
    built = spy_mosaic_builds(monkeypatch)
    prefill = make_attention(1, 64, 64, 512, 300, 9000, 128, 512, ragged=True, fp8=False)
    for inp in (bf16, prefill):   # decode and prefill shapes (where the pair's default is split_d / split_scores)
        lowers_for("cuda", "mosaic_gpu", lambda *a: sparse_attention_mosaic(*a, scale=0.1, consumers="asym"),
                   *(inp[k] for k in keys))
    for dequant in ("direct", "converter", None):   # (None: the default, the converter)
        lowers_for("cuda", "mosaic_gpu", lambda *a: sparse_attention_mosaic(*a, scale=0.1, consumers="asym",
                                                                             fp8_dequant=dequant),
                   *(fp8[k] for k in keys))
    assert [(b["asym"], b["split_d"], b["split_scores"], b["pingpong"], b["bk"], b.get("direct", False),
             b.get("conv", False)) for b in built] == \
        [(True, False, False, False, 64, False, False)] * 2 + [(True, False, False, False, 64, True, False)] + \
        [(True, False, False, False, 32, False, True)] * 2


OPTION_KEYS = ("q", "window_kv", "window_idx", "compressed_kv", "compressed_idx", "sinks")


def option_cases():
    """The Mosaic wrapper-option tests' inputs: a bf16 and an FP8 CSA decode case (2 rows, ragged lengths), and
    call(inp, **options), the wrapper on one of them (its ValueErrors are what those tests look for)."""
    from pallas_kernels.sparse_attention import gpu_mosaic

    bf16 = make_attention(2, 1, 64, 512, 300, 9000, 128, 512, ragged=True, fp8=False)
    fp8 = make_attention(2, 1, 64, 512, 300, 9000, 128, 512, ragged=True, fp8=True)
    return bf16, fp8, lambda inp, **o: gpu_mosaic.sparse_attention_mosaic(*(inp[k] for k in OPTION_KEYS), scale=0.1,
                                                                          **o)


def refused_outside_asym_converter(call, bf16, fp8, name, bad_values, value, bad_match, mode_match):
    """An option of FP8's asym over the converter's tiles: each of bad_values is refused as out of range, and value
    is refused for bf16 pools, the pair, and the direct and producer tile rings."""
    for bad in bad_values:
        with pytest.raises(ValueError, match=bad_match):
            call(fp8, **{name: bad})
    for inp, opts in [(bf16, {}), (fp8, dict(consumers="pair")), (fp8, dict(fp8_dequant="direct")),
                      (fp8, dict(fp8_dequant="producer"))]:
        with pytest.raises(ValueError, match=mode_match):
            call(inp, **{name: value}, **opts)


def test_sparse_attention_mosaic_f16_operands_reject_what_they_cannot_do(monkeypatch):
    """fp8_operands="f16" (session 69) runs FP8 pools through the converter's tiles under consumers="asym" only, not
    with the bf16 bit-pattern conversions ("bits", "rebias"); "no_q_convert" is its diagnostic alone; where it
    applies the build gets f16, and with fp8_operands=None the module default decides only where f16 applies."""
    from pallas_kernels.sparse_attention import gpu_mosaic

    keys = OPTION_KEYS
    bf16, fp8, call = option_cases()
    with pytest.raises(ValueError, match="fp8_operands must be"):
        call(fp8, fp8_operands="f32")
    for inp, opts in [(bf16, {}), (fp8, dict(consumers="pair")), (fp8, dict(fp8_dequant="direct")),
                      (fp8, dict(fp8_dequant="producer")), (fp8, dict(fp8_dequant="consumers")),
                      (fp8, dict(_diag="bits"))]:
        with pytest.raises(ValueError, match="fp8_operands='f16' runs FP8 pools"):
            call(inp, fp8_operands="f16", **opts)
    with pytest.raises(ValueError, match="rebias"):
        call(fp8, fp8_operands="f16", fp8_convert="rebias")
    with pytest.raises(ValueError, match="no_q_convert"):
        call(fp8, _diag="no_q_convert", fp8_operands="bf16")
    for dequant in ("consumers", "direct"):   # the "owned" chunk order is the 32-row tile ring's
        with pytest.raises(ValueError, match="fp8_chunk_order='owned'"):
            call(fp8, fp8_chunk_order="owned", fp8_dequant=dequant)
    built = spy_mosaic_builds(monkeypatch)
    lowers_for("cuda", "mosaic_gpu", lambda *a: gpu_mosaic.sparse_attention_mosaic(*a, scale=0.1,
                                                                                    fp8_operands="f16"),
               *(fp8[k] for k in keys))
    monkeypatch.setattr(gpu_mosaic, "DEFAULT_FP8_OPERANDS", "f16")   # a default of f16 applies where it fits
    for inp, opts in [(fp8, {}), (fp8, dict(consumers="pair")), (fp8, dict(_diag="bits")), (bf16, {}),
                      (fp8, dict(fp8_convert="rebias"))]:   # (a caller's rebias keeps bf16 operands)
        lowers_for("cuda", "mosaic_gpu", lambda *a: gpu_mosaic.sparse_attention_mosaic(*a, scale=0.1, **opts),
                   *(inp[k] for k in keys))
    assert [b.get("f16", False) for b in built] == [True, True, False, False, False, False]


def test_sparse_attention_mosaic_fp8_copy_options(monkeypatch):
    """fp8_copy (session 70) names how the producer issues FP8 rows into a staging ring: FP8 pools only, never with
    fp8_dequant="direct" (no staging ring), "tma" or "bulk"; the build gets it, and fp8_copy=None takes
    the module default where a staging ring exists, "tma" elsewhere."""
    from pallas_kernels.sparse_attention import gpu_mosaic

    keys = OPTION_KEYS
    bf16, fp8, call = option_cases()
    for bad in ("cp_async", "lanes"):   # ("lanes": a mode that faulted on an H100 in session 70, removed)
        with pytest.raises(ValueError, match="fp8_copy must be"):
            call(fp8, fp8_copy=bad)
    for inp, opts in [(bf16, {}), (fp8, dict(fp8_dequant="direct"))]:
        with pytest.raises(ValueError, match="staging ring"):
            call(inp, fp8_copy="bulk", **opts)
    built = spy_mosaic_builds(monkeypatch)
    lowers_for("cuda", "mosaic_gpu", lambda *a: gpu_mosaic.sparse_attention_mosaic(*a, scale=0.1, fp8_copy="bulk"),
               *(fp8[k] for k in keys))
    monkeypatch.setattr(gpu_mosaic, "DEFAULT_FP8_COPY", "bulk")   # a default applies where a staging ring exists
    for inp, opts in [(fp8, {}), (fp8, dict(fp8_dequant="direct")), (bf16, {})]:
        lowers_for("cuda", "mosaic_gpu", lambda *a: gpu_mosaic.sparse_attention_mosaic(*a, scale=0.1, **opts),
                   *(inp[k] for k in keys))
    assert [b.get("fp8_copy", "tma") for b in built] == ["bulk", "bulk", "tma", "tma"]


def test_sparse_attention_mosaic_asym_scorer_cols(monkeypatch):
    """asym_scorer_cols (session 70) moves P.V columns from the scorer to the helper over the FP8 converter's tiles
    under consumers="asym" only; 128 or d / 2; regs then takes the consumers' counts apart (a 4-tuple, only there),
    and by default the 3-tuple's consumer count -/+ UNEVEN_REG_SHIFT. The build gets the columns and the registers."""
    from pallas_kernels.sparse_attention import gpu_mosaic

    keys = OPTION_KEYS
    bf16, fp8, call = option_cases()
    refused_outside_asym_converter(call, bf16, fp8, "asym_scorer_cols", (64, 384, 0, True, 128.0), 128,
                                   "asym_scorer_cols must be", "asym_scorer_cols below d / 2")
    with pytest.raises(ValueError, match="scorer, helper"):
        call(fp8, asym_scorer_cols=256, regs=(40, 56, 184, 232))
    for regs in [(40, 56, 208), (40, 56, 192, 240), (40, 56, 120, 296)]:   # 3-tuple, over the pool, over 256
        with pytest.raises(ValueError, match="regs must be"):
            call(fp8, asym_scorer_cols=128, regs=regs)
    built = spy_mosaic_builds(monkeypatch)
    lowers_for("cuda", "mosaic_gpu", lambda *a: gpu_mosaic.sparse_attention_mosaic(*a, scale=0.1,
                                                                                    asym_scorer_cols=128),
               *(fp8[k] for k in keys))
    monkeypatch.setattr(gpu_mosaic, "DEFAULT_ASYM_SCORER_COLS", 128)   # a default applies where it fits
    for inp, opts in [(fp8, {}), (fp8, dict(consumers="pair")), (bf16, {}),
                      (fp8, dict(regs=(40, 56, 208)))]:   # (a caller's 3-entry regs: the even split)
        lowers_for("cuda", "mosaic_gpu", lambda *a: gpu_mosaic.sparse_attention_mosaic(*a, scale=0.1, **opts),
                   *(inp[k] for k in keys))
    p_, v_, c_ = gpu_mosaic.CONV_REGS
    shift = gpu_mosaic.UNEVEN_REG_SHIFT
    assert [(b["scorer_cols"], b["regs"]) for b in built[:2]] == [(128, (p_, v_, c_ - shift, c_ + shift))] * 2
    assert [b["scorer_cols"] for b in built[2:]] == [256, 256, 256]
    assert built[-1]["regs"] == (40, 56, 208)


def test_sparse_attention_mosaic_asym_q_regs(monkeypatch):
    """asym_q_regs (session 70): q's first columns in the scorer's registers, over the FP8 converter's tiles under
    consumers="asym" only; a multiple of 64 in [0, d]; the build gets it, and None takes the module default only
    where it applies."""
    from pallas_kernels.sparse_attention import gpu_mosaic

    keys = OPTION_KEYS
    bf16, fp8, call = option_cases()
    refused_outside_asym_converter(call, bf16, fp8, "asym_q_regs", (32, 576, -64, True, 64.0), 128,
                                   "asym_q_regs must be", "asym_q_regs gives the scorer")
    built = spy_mosaic_builds(monkeypatch)
    lowers_for("cuda", "mosaic_gpu", lambda *a: gpu_mosaic.sparse_attention_mosaic(*a, scale=0.1, asym_q_regs=128),
               *(fp8[k] for k in keys))
    monkeypatch.setattr(gpu_mosaic, "DEFAULT_ASYM_Q_REGS", 192)   # a default applies where it fits
    for inp, opts in [(fp8, {}), (fp8, dict(consumers="pair")), (bf16, {}),
                      (fp8, dict(asym_scorer_cols=256))]:   # (the default only with the uneven split)
        lowers_for("cuda", "mosaic_gpu", lambda *a: gpu_mosaic.sparse_attention_mosaic(*a, scale=0.1, **opts),
                   *(inp[k] for k in keys))
    assert [b["q_reg_cols"] for b in built] == [128, 192, 0, 0, 0]


def test_mosaic_scratch_swizzled_buffers_must_be_1k_aligned():
    """Mosaic GPU packs scratch buffers back to back; a tiled bf16 buffer (what wgmma / TMA read swizzled) after
    768 B of FP8 scale rows is misaligned, which the hardware's swizzle would read wrongly without an error (session
    68's first GPU run of the converter's asym P slots). The check names it; the same buffers in an aligned order,
    an f32 exchange buffer and barriers (8 B each) ahead of an aligned offset pass."""
    import jax.experimental.mosaic.gpu as mgpu
    from pallas_kernels.sparse_attention.gpu_mosaic import _check_swizzle_alignment

    sds = jax.ShapeDtypeStruct
    ring = sds((2, 4, 16, 8, 32), jnp.bfloat16)     # 64 KB: ends 1 KB aligned
    scales = sds((3, 32, 8), jnp.uint8)             # 768 B
    p_slots = sds((2, 8, 1, 8, 32), jnp.bfloat16)   # swizzled (wgmma's A operand)
    with pytest.raises(AssertionError, match="at byte 66304, not 1 KB aligned"):
        _check_swizzle_alignment(((ring, scales, p_slots), (mgpu.Barrier(arrival_count=1),)))
    _check_swizzle_alignment(((ring, p_slots, scales), (mgpu.Barrier(arrival_count=1),)))
    _check_swizzle_alignment(((ring, scales, sds((2, 8, 1, 8, 32), jnp.float32)),))   # f32: store/load_tiled only
    _check_swizzle_alignment(((ring, sds((248,), jnp.float32)), (mgpu.Barrier(arrival_count=1, num_barriers=4),),
                              (p_slots,)))   # 992 B + 4 barriers = 1 KB


def test_sparse_attention_mosaic_default_consumers_yield_to_the_pairs_modes(monkeypatch):
    """With "asym" as the default (DEFAULT_CONSUMERS: bf16's since session 66, FP8's since 68) a call without
    options builds asym, and one that names a pair mode (split_d, split_scores, piece_barriers, block_k 32, the
    cp.async producer) builds the pair instead of raising; likewise for FP8 pools (an "asym" default there would
    build asym over the tile rings that take it: the direct gather's and the converter's, the default one)."""
    from pallas_kernels.sparse_attention import gpu_mosaic

    monkeypatch.setattr(gpu_mosaic, "DEFAULT_CONSUMERS", {"bf16": "asym", "fp8": "asym"})
    built = spy_mosaic_builds(monkeypatch)
    keys = ("q", "window_kv", "window_idx", "compressed_kv", "compressed_idx", "sinks")
    bf16 = make_attention(2, 1, 64, 512, 300, 9000, 128, 512, ragged=True, fp8=False)
    fp8 = make_attention(2, 1, 64, 512, 300, 9000, 128, 512, ragged=True, fp8=True)
    cases = [(bf16, {}, True), (bf16, dict(lazy_rescale=True, n_splits=2), True), (bf16, dict(split_d=True), False),
             (bf16, dict(split_d=False), False), (bf16, dict(piece_barriers=False), False),
             (bf16, dict(block_k=32, num_stages=4), False), (bf16, dict(producer="cp_async"), False),
             (fp8, {}, True), (fp8, dict(fp8_dequant="direct"), True), (fp8, dict(fp8_dequant="converter"), True),
             (fp8, dict(fp8_dequant="producer"), False), (fp8, dict(fp8_dequant="consumers"), False),
             (fp8, dict(regs=(40, 232)), False), (fp8, dict(block_k=32), True),
             (fp8, dict(_diag="bits"), True), (fp8, dict(_diag="no_convert"), True), (fp8, dict(_diag="loop"), False),
             (bf16, dict(_diag="no_convert"), False)]
    for inp, opts, want_asym in cases:
        built.clear()
        lowers_for("cuda", "mosaic_gpu", lambda *a: gpu_mosaic.sparse_attention_mosaic(
            *a, scale=0.1, window_len=inp["window_len"], compressed_len=inp["compressed_len"], **opts),
            *(inp[k] for k in keys))
        assert [a.get("asym", False) for a in built] == [want_asym], opts


def test_sparse_attention_mosaic_fp8_conversion_defaults_per_mode(monkeypatch):
    """FP8 pools: the converter warpgroup (the default) and the direct gather convert with four conversion
    instructions a pair ("cvt", session 67), the producer mode with one ("rebias", session 22); an explicit
    fp8_convert wins in every mode."""
    from pallas_kernels.sparse_attention import gpu_mosaic

    built = spy_mosaic_builds(monkeypatch)
    keys = ("q", "window_kv", "window_idx", "compressed_kv", "compressed_idx", "sinks")
    fp8 = make_attention(2, 1, 64, 512, 300, 9000, 128, 512, ragged=True, fp8=True)
    cases = [({}, "cvt"), (dict(fp8_dequant="direct"), "cvt"), (dict(fp8_dequant="producer"), "rebias"),
             (dict(fp8_dequant="consumers"), "cvt"), (dict(fp8_convert="rebias"), "rebias"),
             (dict(fp8_dequant="producer", fp8_convert="cvt"), "cvt")]
    for opts, want in cases:
        built.clear()
        lowers_for("cuda", "mosaic_gpu", lambda *a: gpu_mosaic.sparse_attention_mosaic(
            *a, scale=0.1, window_len=fp8["window_len"], compressed_len=fp8["compressed_len"], **opts),
            *(fp8[k] for k in keys))
        assert [a.get("fp8_convert", "cvt") for a in built] == [want], opts


@full_tier
def test_sparse_attention_mosaic_split_d_rejects_what_it_cannot_do():
    """split_d (each consumer scores half of d, f32 partials swapped through shared memory) excludes split_scores and
    pingpong; with FP8 pools its 32 KB fit next to one staging slot only."""
    from pallas_kernels.sparse_attention.gpu_mosaic import sparse_attention_mosaic

    keys = ("q", "window_kv", "window_idx", "compressed_kv", "compressed_idx", "sinks")
    for opts in (dict(split_scores=True), dict(pingpong=True)):
        inp = make_attention(2, 1, 64, 512, 300, 9000, 128, 512, ragged=True, fp8=False)
        with pytest.raises(ValueError, match="split_d"):
            sparse_attention_mosaic(*(inp[k] for k in keys), scale=0.1, split_d=True, **opts)
    # FP8 pools: the exchange fits next to one staging slot only (which split_d=True asks for by default)
    inp = make_attention(2, 1, 64, 512, 300, 9000, 128, 512, ragged=True, fp8=True)
    with pytest.raises(ValueError, match="shared memory .* over"):
        sparse_attention_mosaic(*(inp[k] for k in keys), scale=0.1, split_d=True, num_stages=2, n_splits=1,
                                fp8_dequant="consumers")
    lowers_for("cuda", "mosaic_gpu", lambda *a: sparse_attention_mosaic(*a, scale=0.1, split_d=True, n_splits=1),
               *(inp[k] for k in keys))
    # an HCA-8K row in at most 8 cluster splits with its whole index lists in shared memory (idx_stream=False):
    # 1040 index rows per CTA leave no room for the 32 KB exchange, so the default (split_d=None) lowers without it
    # and an explicit split_d=True says why it cannot; streamed (the default there since session 29) both fit
    inp = make_attention(2, 1, 64, 512, 300, 9000, 128, 8192, ragged=True, fp8=False)
    with pytest.raises(ValueError, match="shared memory .* over"):
        sparse_attention_mosaic(*(inp[k] for k in keys), scale=0.1, split_d=True, combine="cluster",
                                idx_stream=False)
    for opts in (dict(idx_stream=False), dict(split_d=True), {}):
        lowers_for("cuda", "mosaic_gpu", lambda *a: sparse_attention_mosaic(*a, scale=0.1, combine="cluster", **opts),
                   *(inp[k] for k in keys))
    # FP8 prefill in one split over 8320 index rows (33 KB) held whole: split_d's buffer does not fit, the default
    # drops it and keeps one staging slot (two would not fit either), and split_scores stays off (it never fits with
    # FP8); streamed, split_d fits
    inp = make_attention(1, 64, 64, 512, 300, 9000, 128, 8192, ragged=True, fp8=True)
    for opts in (dict(idx_stream=False), dict(split_d=True)):
        lowers_for("cuda", "mosaic_gpu", lambda *a: sparse_attention_mosaic(*a, scale=0.1, n_splits=1, **opts),
                   *(inp[k] for k in keys))
    with pytest.raises(ValueError, match="shared memory .* over"):
        sparse_attention_mosaic(*(inp[k] for k in keys), scale=0.1, n_splits=1, split_d=True, idx_stream=False)


@full_tier
def test_sparse_attention_mosaic_fp8_dequant_producer_rejects_what_it_cannot_do():
    """fp8_dequant="producer" / "converter" convert FP8 pools into 32-row bf16 tiles for the split_d consumers, and
    "direct" into 64-row ones: bf16 pools, other block sizes, split_d off, the consumers' own dequantization
    variants and register splits the CTA cannot cover are refused, with the reason."""
    from pallas_kernels.sparse_attention.gpu_mosaic import sparse_attention_mosaic

    keys = ("q", "window_kv", "window_idx", "compressed_kv", "compressed_idx", "sinks")
    bf16 = make_attention(2, 1, 64, 512, 300, 9000, 128, 512, ragged=True)
    with pytest.raises(ValueError, match="dequantizes FP8 pools"):
        sparse_attention_mosaic(*(bf16[k] for k in keys), scale=0.1, fp8_dequant="producer")
    fp8 = [make_attention(2, 1, 64, 512, 300, 9000, 128, 512, ragged=True, fp8=True)[k] for k in keys]
    for opts, match in [(dict(block_k=64), "takes block_k=32"), (dict(split_d=False), "runs with split_d"),
                        (dict(fp8_overlap=True), "without"), (dict(_diag="dequant_both"), "without"),
                        (dict(num_stages=5), "1-4 staging slots"), (dict(fp8_dequant="warp"), "must be")]:
        with pytest.raises(ValueError, match=match):
            sparse_attention_mosaic(*fp8, scale=0.1, **{"fp8_dequant": "producer", **opts})
    with pytest.raises(ValueError, match="block_k=64 .* fp8_dequant='producer'"):
        sparse_attention_mosaic(*fp8, scale=0.1, block_k=32, fp8_dequant="consumers")
    # fp8_dequant="converter" (a fourth warpgroup, 512 threads): the same limits, and a three-way register split
    # within the 128 registers per thread a 512-thread CTA starts with
    with pytest.raises(ValueError, match="takes block_k=32"):
        sparse_attention_mosaic(*fp8, scale=0.1, fp8_dequant="converter", block_k=64)
    for regs in ((56, 224), (40, 64, 208), (136, 24, 176), (40, 56, 120)):
        with pytest.raises(ValueError, match="producer, converter, consumer"):
            sparse_attention_mosaic(*fp8, scale=0.1, fp8_dequant="converter", regs=regs)
    # conv_units: the converter's share of the 9 passes, with the converter mode only
    for mode, units in (("converter", 0), ("converter", 10), ("converter", 4.5), ("converter", True),
                        ("producer", 5), ("consumers", 5)):
        with pytest.raises(ValueError, match="conv_units"):
            sparse_attention_mosaic(*fp8, scale=0.1, fp8_dequant=mode, conv_units=units)
    with pytest.raises(ValueError, match="fp8_chunk_order"):
        sparse_attention_mosaic(*fp8, scale=0.1, fp8_chunk_order="columns")
    # tile_slots: the tile ring's depth, 2-4, with a tile-ring mode only; three tiles need two staging slots, and an
    # explicit tile_slots that does not fit says so (no fallback to the consumers' conversion)
    for mode, slots in (("converter", 1), ("converter", 5), ("producer", 2.0), ("consumers", 3)):
        with pytest.raises(ValueError, match="tile_slots"):
            sparse_attention_mosaic(*fp8, scale=0.1, fp8_dequant=mode, tile_slots=slots)
    with pytest.raises(ValueError, match="shared memory .* over"):
        sparse_attention_mosaic(*fp8, scale=0.1, tile_slots=3)
    # lazy_rescale: a bool, and not with split_scores (its integer running max; the default for bf16 prefill)
    with pytest.raises(ValueError, match="lazy_rescale must be"):
        sparse_attention_mosaic(*fp8, scale=0.1, lazy_rescale=1)
    bf16_prefill = [make_attention(1, 64, 64, 512, 300, 600, 128, 60)[k] for k in keys]
    with pytest.raises(ValueError, match="not with split_scores"):
        sparse_attention_mosaic(*bf16_prefill, scale=0.1, lazy_rescale=True, split_scores=True)
    # conv_batch: 1-9 chunks per batch, with a tile-ring mode only; explicit, it keeps the tile ring (no fallback)
    for mode, batch in (("converter", 0), ("converter", 10), ("producer", 2.0), ("converter", True),
                        ("consumers", 2)):
        with pytest.raises(ValueError, match="conv_batch"):
            sparse_attention_mosaic(*fp8, scale=0.1, fp8_dequant=mode, conv_batch=batch)
    long = [make_attention(1, 64, 64, 512, 300, 9000, 128, 8192, ragged=True, fp8=True)[k] for k in keys]
    with pytest.raises(ValueError, match="shared memory .* over"):   # whole index lists: the default falls back
        sparse_attention_mosaic(*long, scale=0.1, n_splits=1, conv_batch=2, idx_stream=False)
    with pytest.raises(ValueError, match="producer, converter, consumer"):   # the shared default is (56, 56, 200)
        sparse_attention_mosaic(*fp8, scale=0.1, fp8_dequant="converter", conv_units=5, regs=(64, 64, 200))
    # fp8_dequant="direct" (the producer gathers the rows itself, no staging ring): block_k 64 or 32, no num_stages
    # (nothing is staged), conv_batch within a step's passes (18 at block_k 64) and only with register staging, a
    # two-tile ring of 64 rows with no room for a third, and its own knobs with it only
    with pytest.raises(ValueError, match="dequantizes FP8 pools"):
        sparse_attention_mosaic(*(bf16[k] for k in keys), scale=0.1, fp8_dequant="direct")
    for opts, match in [(dict(block_k=128), "takes block_k=64"), (dict(split_d=False), "runs with split_d"),
                        (dict(num_stages=2), "num_stages does not apply"), (dict(conv_batch=19), "conv_batch"),
                        (dict(conv_batch=0), "conv_batch"), (dict(block_k=32, conv_batch=10), "conv_batch"),
                        (dict(conv_batch=4), "direct_staging='tile'"), (dict(direct_staging="smem"), "must be"),
                        (dict(block_k=32, direct_staging="tile"), "direct_staging='tile'"),
                        (dict(tile_slots=3), "shared memory .* over"), (dict(regs=(96, 208)), "regs must be"),
                        (dict(direct_prefetch="lines"), "direct_prefetch must be")]:
        with pytest.raises(ValueError, match=match):
            sparse_attention_mosaic(*fp8, scale=0.1, fp8_dequant="direct", **opts)
    for knob, value in (("direct_staging", "tile"), ("direct_prefetch", True)):
        with pytest.raises(ValueError, match=f"{knob} applies"):
            sparse_attention_mosaic(*fp8, scale=0.1, fp8_dequant="converter", **{knob: value})


def test_sparse_attention_mosaic_piece_barriers_rejects_what_it_cannot_do():
    """piece_barriers waits for each bulk-copied piece of d of a bf16 ring under split_d: FP8 pools, the cp.async
    producer (block_k=32), split_scores, pingpong and split_d off are refused, with the reason."""
    from pallas_kernels.sparse_attention.gpu_mosaic import sparse_attention_mosaic

    keys = ("q", "window_kv", "window_idx", "compressed_kv", "compressed_idx", "sinks")
    bf16 = [make_attention(2, 1, 64, 512, 300, 9000, 128, 512, ragged=True)[k] for k in keys]
    fp8 = [make_attention(2, 1, 64, 512, 300, 9000, 128, 512, ragged=True, fp8=True)[k] for k in keys]
    with pytest.raises(ValueError, match="not with FP8 pools"):
        sparse_attention_mosaic(*fp8, scale=0.1, piece_barriers=True)
    with pytest.raises(ValueError, match="piece_barriers must be"):
        sparse_attention_mosaic(*bf16, scale=0.1, piece_barriers="columns")
    for opts, match in [(dict(producer="cp_async"), "piece_barriers"), (dict(block_k=32), "bulk-copy producer"),
                        (dict(split_scores=True, split_d=False), "piece_barriers"),
                        (dict(pingpong=True, split_d=False), "piece_barriers"),
                        (dict(split_d=False), "piece_barriers")]:
        with pytest.raises(ValueError, match=match):
            sparse_attention_mosaic(*bf16, scale=0.1, piece_barriers=True, **opts)


def test_sparse_attention_mosaic_score_ahead_builds_and_rejects(monkeypatch):
    """score_ahead runs split_d's consumers one score wgmma ahead: FP8 pools get the three-tile ring next to two
    staging slots by default (explicit depths kept); the options it cannot combine with are refused, with the
    reason; the default is off."""
    from pallas_kernels.sparse_attention.gpu_mosaic import sparse_attention_mosaic

    keys = ("q", "window_kv", "window_idx", "compressed_kv", "compressed_idx", "sinks")
    bf16 = [make_attention(2, 1, 64, 512, 300, 9000, 128, 512, ragged=True)[k] for k in keys]
    fp8 = [make_attention(2, 1, 64, 512, 300, 9000, 128, 512, ragged=True, fp8=True)[k] for k in keys]
    built = spy_mosaic_builds(monkeypatch)
    for pools, opts, want in [(fp8, {}, dict(ahead=True, n_tiles=3, stages=2, conv=True)),
                              (fp8, dict(tile_slots=2, num_stages=3), dict(ahead=True, n_tiles=2, stages=3)),
                              (bf16, dict(block_k=32, num_stages=4), dict(ahead=True, stages=4, piece_bars=False))]:
        jax.jit(lambda *a: sparse_attention_mosaic(*a, scale=0.1, score_ahead=True, **opts)).trace(*pools).lower(
            lowering_platforms=("cuda",))
        assert {k: built[-1][k] for k in want} == want, (opts, built[-1])
    jax.jit(lambda *a: sparse_attention_mosaic(*a, scale=0.1)).trace(*fp8).lower(lowering_platforms=("cuda",))
    assert not built[-1].get("ahead", False) and built[-1]["n_tiles"] == 2 and built[-1]["stages"] == 3
    for pools, opts in [(bf16, dict(piece_barriers=True)), (bf16, dict(split_scores=True, split_d=False)),
                        (bf16, dict(pingpong=True, split_d=False)), (bf16, dict(split_d=False)),
                        (fp8, dict(fp8_dequant="consumers")), (fp8, dict(fp8_overlap=True))]:
        with pytest.raises(ValueError, match="score_ahead overlaps"):
            sparse_attention_mosaic(*pools, scale=0.1, score_ahead=True, **opts)
    with pytest.raises(ValueError, match="score_ahead must be a bool"):
        sparse_attention_mosaic(*bf16, scale=0.1, score_ahead="yes")


def test_sparse_attention_mosaic_fp8_overlap_needs_fp8_split_d():
    """fp8_overlap interleaves a consumer's conversion of its half of d with its score wgmma: FP8 pools with split_d
    only, and not with a diagnostic that changes the dequantization order."""
    from pallas_kernels.sparse_attention.gpu_mosaic import sparse_attention_mosaic

    keys = ("q", "window_kv", "window_idx", "compressed_kv", "compressed_idx", "sinks")
    bf16 = make_attention(2, 1, 64, 512, 300, 9000, 128, 512, ragged=True)
    with pytest.raises(ValueError, match="fp8_overlap .* bf16 pools"):
        sparse_attention_mosaic(*(bf16[k] for k in keys), scale=0.1, fp8_overlap=True)
    fp8 = make_attention(2, 1, 64, 512, 300, 9000, 128, 512, ragged=True, fp8=True)
    for opts in (dict(split_d=False), dict(num_stages=2)):
        with pytest.raises(ValueError, match="fp8_overlap .* split_d only"):
            sparse_attention_mosaic(*(fp8[k] for k in keys), scale=0.1, fp8_overlap=True, **opts)
    with pytest.raises(ValueError, match="not with _diag='dequant_both'"):
        sparse_attention_mosaic(*(fp8[k] for k in keys), scale=0.1, fp8_overlap=True, _diag="dequant_both")


def test_sparse_attention_mosaic_pingpong_rejects_fp8_and_split_scores():
    """pingpong (the consumers take turns at the tensor cores) needs consumers that do not meet every step: FP8's
    dequantization and split_scores' exchange both put a shared barrier in each step."""
    from pallas_kernels.sparse_attention.gpu_mosaic import sparse_attention_mosaic

    keys = ("q", "window_kv", "window_idx", "compressed_kv", "compressed_idx", "sinks")
    for fp8, t, opts in [(True, 1, {}), (False, 64, dict(split_scores=True)), (False, 64, {})]:
        inp = make_attention(1, t, 64, 512, 300, 9000, 128, 512, ragged=True, fp8=fp8)
        with pytest.raises(ValueError, match="pingpong"):
            sparse_attention_mosaic(*(inp[k] for k in keys), scale=512 ** -0.5, window_len=inp["window_len"],
                                    compressed_len=inp["compressed_len"], pingpong=True, **opts)


def test_sparse_attention_mosaic_counts_its_barriers_in_shared_memory():
    """A ring that fills shared memory to the byte (block_k=32 x 5 slots next to the q tile and one split's 640 index
    rows) leaves no room for the kernel's mbarriers: with the default split count the wrapper splits the rows
    further and the kernel lowers; with n_splits=1 it raises its own error, not Mosaic's."""
    from pallas_kernels.sparse_attention.gpu_mosaic import sparse_attention_mosaic

    inp = make_attention(128, 1, 64, 512, 300, 9000, 128, 512, ragged=True)
    keys = ("q", "window_kv", "window_idx", "compressed_kv", "compressed_idx", "sinks")
    kw = dict(scale=512 ** -0.5, window_len=inp["window_len"], compressed_len=inp["compressed_len"], block_k=32,
              num_stages=5)
    lowers_for("cuda", "mosaic_gpu", lambda *a: sparse_attention_mosaic(*a, **kw), *(inp[k] for k in keys))
    with pytest.raises(ValueError, match="shared memory .* over"):
        sparse_attention_mosaic(*(inp[k] for k in keys), **kw, n_splits=1)


@pytest.mark.parametrize("b,k_c,fp8,opts,ring,max_ns", [
    (16, 8192, False, dict(consumers="pair"), 3, 8),   # HCA-8K decode: the pair's whole lists would not fit at
    full(16, 8192, False, dict(consumers="pair", idx_stream=False), 0, None),   # 8 splits -> streamed; whole: split
    (16, 8192, False, dict(consumers="asym"), 0, 8),   # further. asym (10 KB less) holds them whole at 8
    full(16, 8192, True, dict(n_splits=2), 0, 2),   # FP8 tile ring: 4160 entries a split still fit whole ...
    (16, 8192, True, dict(n_splits=1), 6, 1),   # ... 8320 do not: a ring of 3 staging + 2 tiles + 1 steps
    (4, 512, False, {}, 0, None),            # CSA decode: the lists fit, held whole
    full(4, 512, False, dict(idx_stream=True), 3, None),
])
def test_sparse_attention_mosaic_streams_long_index_lists(monkeypatch, b, k_c, fp8, opts, ring, max_ns):
    """idx_stream=None streams a CTA's index rows through a ring of (stages + tiles + 1) steps where its split's
    whole lists do not fit next to the rest of shared memory at the default split count, and keeps them whole
    elsewhere; idx_stream=False is the old behaviour (split further). Checked on the kernel the wrapper builds."""
    from pallas_kernels.sparse_attention import gpu_mosaic

    built = spy_mosaic_builds(monkeypatch)
    inp = make_attention(b, 1, 64, 512, 300, 9000, 128, k_c, ragged=True, fp8=fp8)
    keys = ("q", "window_kv", "window_idx", "compressed_kv", "compressed_idx", "sinks")
    lowers_for("cuda", "mosaic_gpu", lambda *a: gpu_mosaic.sparse_attention_mosaic(
        *a, scale=0.1, window_len=inp["window_len"], compressed_len=inp["compressed_len"], **opts),
        *(inp[k] for k in keys))
    (ns, idx_ring), = [(a["ns"], a.get("idx_ring", 0)) for a in built]
    assert idx_ring == ring
    if max_ns is not None:
        assert ns <= max_ns
    elif not ring and k_c == 8192:
        assert ns > 8


@pytest.mark.parametrize("b,k_c,fp8", [(136, 8192, False), full(136, 8192, True), (136, 512, False)])
def test_sparse_attention_mosaic_splits_past_one_wave(monkeypatch, b, k_c, fp8):
    """Past one wave of CTAs the wrapper builds `wave_splits`' count (HCA-8K at B = 136: several splits and the XLA
    merge; CSA: one split a row) and lowers."""
    from pallas_kernels.sparse_attention import common, gpu_mosaic

    built = spy_mosaic_builds(monkeypatch)
    inp = make_attention(b, 1, 64, 512, 300, 9000, 128, k_c, ragged=True, fp8=fp8)
    keys = ("q", "window_kv", "window_idx", "compressed_kv", "compressed_idx", "sinks")
    lowers_for("cuda", "mosaic_gpu", lambda *a: gpu_mosaic.sparse_attention_mosaic(
        *a, scale=0.1, window_len=inp["window_len"], compressed_len=inp["compressed_len"]), *(inp[k] for k in keys))
    (ns,) = [a["ns"] for a in built]
    assert ns == common.wave_splits(b, (128 + k_c) // 64)
    assert (ns > 1) is (k_c == 8192)


def test_sparse_attention_mosaic_idx_stream_rejects_what_it_cannot_do():
    """The ring is filled by the TMA producer's threads one step ahead: not with the cp.async producer (block_k=32
    over bf16 pools), L2 prefetches of later steps' rows (they read the entries ahead of the ring), or more than one
    entry per producer thread (block_k > 128)."""
    from pallas_kernels.sparse_attention.gpu_mosaic import sparse_attention_mosaic

    inp = make_attention(3, 1, 64, 512, 300, 9000, 128, 512, ragged=True)
    args = [inp[k] for k in ("q", "window_kv", "window_idx", "compressed_kv", "compressed_idx", "sinks")]
    for opts in (dict(block_k=32, num_stages=4), dict(producer="cp_async"), dict(l2_ahead=2),
                 dict(block_k=256, num_stages=1, n_splits=1, split_d=False)):
        with pytest.raises(ValueError, match="idx_stream=True"):
            sparse_attention_mosaic(*args, scale=0.1, idx_stream=True, **opts)


def test_sparse_attention_mosaic_block_k32_rejects_bulk_copies():
    """32-entry rings (64 B swizzle) are gathered with cp.async: a bulk tensor copy's shared-memory destination must
    be 128 B aligned, and odd rows of a 64 B-swizzled tile start 64 B into a line (the H200 faulted, session 15)."""
    from pallas_kernels.sparse_attention.gpu_mosaic import sparse_attention_mosaic

    inp = make_attention(3, 1, 64, 512, 300, 9000, 128, 512, ragged=True)
    keys = ("q", "window_kv", "window_idx", "compressed_kv", "compressed_idx", "sinks")
    with pytest.raises(ValueError, match="block_k=32 .* needs producer='cp_async'"):
        sparse_attention_mosaic(*(inp[k] for k in keys), scale=512 ** -0.5, window_len=inp["window_len"],
                                compressed_len=inp["compressed_len"], block_k=32, num_stages=4, producer="tma")


@pytest.mark.parametrize("b,t,k_c,opts,fp8", [(3, 1, 512, {}, False), full(1, 64, 60, {}, False),
                                              full(3, 1, 512, {}, True),
                                              full(2, 1, 1024, dict(n_splits=2, heads=128), False)])
def test_sparse_attention_mosaic_profiled_builds(b, t, k_c, opts, fp8):
    """With `_profile` the kernel records its phases through Mosaic GPU's profiler: its module builds (tracing the
    call builds it; the per-call trace dump is a host callback, which does not lower for another platform)."""
    from pallas_kernels.sparse_attention.gpu_mosaic import sparse_attention_mosaic

    opts = dict(opts)
    inp = make_attention(b, t, opts.pop("heads", 64), 512, 300, 9000, 128, k_c, ragged=True, fp8=fp8)
    keys = ("q", "window_kv", "window_idx", "compressed_kv", "compressed_idx", "sinks")
    lens = dict(window_len=inp["window_len"], compressed_len=inp["compressed_len"])
    fn = lambda *a: sparse_attention_mosaic(*a, scale=512 ** -0.5, **lens, _profile="/tmp", **opts)
    jaxpr = str(jax.jit(fn).trace(*(inp[k] for k in keys)).jaxpr)
    assert "mosaic_gpu" in jaxpr and "callback" in jaxpr   # the kernel, and the dump of its profile buffer


@full_tier
@pytest.mark.parametrize("kv_dtype,heads", [(None, 64), ("fp8", 64), (None, 128)])
def test_whole_bf16_model_lowers_with_mosaic_attention(monkeypatch, kv_dtype, heads):
    """A bf16 model with 64 heads (128: V4-Pro's, two head groups per query row) takes the Mosaic GPU attention
    kernel in every layer type (prefill and decode), with exact caches and with FP8 KV caches (head_dim 512, the FP8
    row layout's); with attention_kernel="auto" too for 128 heads."""
    from flax import nnx

    import pallas_kernels.dispatch as dispatch
    from dsv4_jax.config import tiny
    from dsv4_jax.model import DeepseekV4ForCausalLM

    monkeypatch.setattr(dispatch.jax, "default_backend", lambda: "gpu")
    if kv_dtype:
        cfg = tiny(num_attention_heads=64, head_dim=512, qk_rope_head_dim=64, o_groups=8, index_head_dim=64)
    else:
        cfg = tiny(num_attention_heads=heads, head_dim=128, qk_rope_head_dim=16, o_groups=8)
    model = DeepseekV4ForCausalLM(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), attention_impl="pallas",
                                  attention_kernel="mosaic" if heads == 64 else "auto")
    cache = model.init_cache(2, 24, **(dict(kv_dtype=kv_dtype) if kv_dtype else {}))
    lower_model_steps(model, cache, "mosaic_gpu")


def test_fp8_rebias_conversion_is_exact_for_every_byte_and_scale():
    """The arithmetic of gpu_mosaic.REBIAS_ASM (fp8_convert="rebias"), emulated step by step in numpy for every
    e4m3 byte (NaNs excluded: the quantizer never writes them) and every scale byte the format writes (0..254):
    e4m3x2 -> f16x2, the f16 bits shifted into bf16 position, two bf16 multiplies by 2^a and 2^b (a + b = 112 + k).
    It must equal the reference's dequantization, e4m3 x 2^k rounded once to bf16, bit for bit."""
    import ml_dtypes
    import numpy as np

    e4m3 = np.arange(256, dtype=np.uint8)
    e4m3 = e4m3[(e4m3 & 0x7F) != 0x7F]
    sbytes = np.arange(255, dtype=np.int32)
    h = e4m3.view(ml_dtypes.float8_e4m3fn).astype(np.float16).view(np.uint16).astype(np.uint32)
    t = ((h & 0x7FFF) >> 3) | (h & 0x8000)                    # and / shr / lop3
    bf = lambda bits: np.asarray(bits, np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)
    tv = bf(t)[:, None]                                        # [bytes, 1]: value x 2^-112
    e = sbytes - 15
    a = e >> 1
    pa, pb = bf((a + 127) << 7), bf((e - a + 127) << 7)        # 2^a, 2^b (bf16 normals)
    # mul.rn.bf16x2: the product of two bf16 values is exact in f32 here, then one round to bf16
    with np.errstate(over="ignore"):   # bytes near 254 overflow to inf, in both
        r1 = (tv * pa[None]).astype(ml_dtypes.bfloat16).astype(np.float32)
        got = (r1 * pb[None]).astype(ml_dtypes.bfloat16)
        scale = np.ldexp(np.float64(1), sbytes - 127)
        want = (e4m3.view(ml_dtypes.float8_e4m3fn).astype(np.float64)[:, None] * scale[None]).astype(np.float32) \
            .astype(ml_dtypes.bfloat16)
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize("B,S,H,T,opts", sweep([core(2, 1, 64, 296, {}),
                                          (3, 2, 16, 1000, dict(block_t=64, num_stages=2)),
                                          (1, 1, 128, 5000, dict(block_t=256, num_splits=3)),
                                          (2, 1, 64, 296, dict(precision="fp8")),
                                          (2, 1, 64, 296, dict(convert="alu")), (3, 2, 16, 1000, dict(convert="mix")),
                                          (2, 1, 64, 296, dict(convert="raw")), (2, 1, 64, 296, dict(split_m=True)),
                                          (3, 2, 16, 1000, dict(split_m=True, precision="fp8", num_stages=2))]))
def test_indexer_mosaic_fp8_lowers(B, S, H, T, opts):
    """The Mosaic GPU fp8 indexer kernel (e4m3 keys from TMA straight into wgmma) lowers for CUDA; heads padded to
    a multiple of 32, T a multiple of 8 (not of the block: TMA fills the last box), 1-2 queries per row."""
    from pallas_kernels.indexer.gpu import indexer_topk_gpu
    from pallas_kernels.indexer.gpu_mosaic import indexer_scores_mosaic

    q, w, keys, nv = make_indexer(B, S, H, T, "fp8", True)
    lowers_for("cuda", "mosaic_gpu", lambda *a: indexer_scores_mosaic(*a, **opts), q, w, keys, nv)
    lowers_for("cuda", "mosaic_gpu", lambda *a: indexer_topk_gpu(*a, k=64, kernel="mosaic", topk="threshold_set",
                                                                **opts), q, w, keys, nv)
    lowers_for("cuda", "mosaic_gpu", lambda *a: indexer_topk_gpu(*a, k=64, kernel="mosaic", fuse_group_max=True,
                                                                topk="threshold_regions_set", **opts), q, w, keys, nv)
    with pytest.raises(ValueError, match="block_t must be"):
        indexer_scores_mosaic(q, w, keys, nv, block_t=96)
    with pytest.raises(ValueError, match="precision must be"):
        indexer_scores_mosaic(q, w, keys, nv, precision="bf16")
    with pytest.raises(ValueError, match="multiple of 8"):
        indexer_scores_mosaic(*make_indexer(1, 1, 16, 300, "fp8"))
    with pytest.raises(ValueError, match="takes fp8 or fp4 keys .* or bf16"):   # f32 keys: the Triton kernel's
        indexer_scores_mosaic(*make_indexer(1, 1, 16, 40, None))


@pytest.mark.parametrize("B,S,H,T,opts", sweep([core(2, 1, 64, 296, {}),
                                          (3, 2, 16, 1000, dict(block_t=64, num_stages=2)),
                                          (1, 1, 128, 5000, dict(block_t=256, num_splits=3)),
                                          (2, 1, 64, 296, dict(split_m=False)), (2, 1, 40, 2000, dict(block_t=192))]))
def test_indexer_mosaic_fp4_lowers(B, S, H, T, opts):
    """The Mosaic GPU kernel over fp4 keys (session 31: packed e2m1 + group scales -> f16 registers by inline PTX in
    `mosaic_fp4`'s register plan) lowers for CUDA, alone and under the threshold top-k with the group maxima; its
    option errors."""
    from pallas_kernels.indexer.gpu import indexer_topk_gpu
    from pallas_kernels.indexer.gpu_mosaic import indexer_scores_mosaic

    q, w, keys, nv = make_indexer(B, S, H, T, "fp4", True)
    lowers_for("cuda", "mosaic_gpu", lambda *a: indexer_scores_mosaic(*a, precision="f16", **opts), q, w, keys, nv)
    lowers_for("cuda", "mosaic_gpu", lambda *a: indexer_topk_gpu(*a, k=64, kernel="mosaic", topk="threshold_set",
                                                                precision="f16", **opts), q, w, keys, nv)
    # precision "fp8" (session 45; the default since session 46): e5m2 operands from the nibbles by table lookup,
    # e5m2 x e5m2 wgmma
    lowers_for("cuda", "mosaic_gpu", lambda *a: indexer_scores_mosaic(*a, **opts), q, w, keys, nv)
    lowers_for("cuda", "mosaic_gpu", lambda *a: indexer_topk_gpu(*a, k=64, kernel="mosaic", topk="segment_set",
                                                                precision="fp8", **opts), q, w, keys, nv)
    # the converter warpgroup (session 49): e5m2 slots in shared memory, alone and under the segment top-k
    # (MOSAIC_CONFIG), the conversion's asm in the module
    from pallas_kernels.indexer import gpu_mosaic

    text = lowers_for("cuda", "mosaic_gpu", lambda *a: indexer_scores_mosaic(*a, fp4_converter=2, **opts), q, w,
                      keys, nv)
    assert "_cv2" in text and "and.b32 m, $2, 0x77777777" in text
    saved = dict(gpu_mosaic.MOSAIC_CONFIG)
    try:
        gpu_mosaic.MOSAIC_CONFIG["fp4_converter"] = 1
        assert "_cv1" in lowers_for("cuda", "mosaic_gpu", lambda *a: indexer_topk_gpu(
            *a, k=64, kernel="mosaic", topk="segment_set", **opts), q, w, keys, nv)
        if opts.get("block_t", 128) % 128 == 0:   # the keys' tables built once a key, through shared memory
            gpu_mosaic.MOSAIC_CONFIG["fp4_tables"] = "shared"
            assert "_cv1_tsh" in lowers_for("cuda", "mosaic_gpu", lambda *a: indexer_topk_gpu(
                *a, k=64, kernel="mosaic", topk="segment_set", **opts), q, w, keys, nv)
            # fp4_layout "rows" (session 50): a thread a key row, 16-byte shared-memory accesses
            gpu_mosaic.MOSAIC_CONFIG.update(fp4_tables="registers", fp4_layout="rows")
            assert "_cv1_rows" in lowers_for("cuda", "mosaic_gpu", lambda *a: indexer_topk_gpu(
                *a, k=64, kernel="mosaic", topk="segment_set", **opts), q, w, keys, nv)
            assert "_cv2_rows" in lowers_for("cuda", "mosaic_gpu", lambda *a: indexer_scores_mosaic(
                *a, fp4_converter=2, **opts), q, w, keys, nv)
        else:
            gpu_mosaic.MOSAIC_CONFIG["fp4_tables"] = "shared"
            with pytest.raises(ValueError, match="block_t must be"):
                indexer_scores_mosaic(q, w, keys, nv, fp4_converter=1, **opts)
    finally:
        gpu_mosaic.MOSAIC_CONFIG.clear()
        gpu_mosaic.MOSAIC_CONFIG.update(saved)
    # the defaults (session 51): 2 converter slots, "rows" where block_t is a multiple of 128, else "fragments";
    # off where the converter cannot run (the raw-conversion probe)
    default = lowers_for("cuda", "mosaic_gpu", lambda *a: indexer_scores_mosaic(*a, **opts), q, w, keys, nv)
    rows_fit = opts.get("block_t", 128) % 128 == 0
    # the scores kernel's own name (the text's locations also name Python helpers, e.g. q_prep's
    # fake_quantize_fp4_rows)
    names = set(re.findall(r"indexer_scores_fp4_\w+", default))
    assert any("_cv2" in n for n in names) and any("_cv2_rows" in n for n in names) == rows_fit, (opts, names)
    assert "_cv" not in lowers_for("cuda", "mosaic_gpu", lambda *a: indexer_scores_mosaic(
        *a, convert="raw", **opts), q, w, keys, nv)
    if not opts.get("split_m"):   # the threshold top-k's chain (group maxima) on the default converter
        assert "_cv2" in lowers_for("cuda", "mosaic_gpu", lambda *a: indexer_topk_gpu(
            *a, k=64, kernel="mosaic", topk="threshold_set", **opts), q, w, keys, nv)
    if not opts:   # the epilogue timing probe (session 48): under the segment top-k too, through MOSAIC_CONFIG
        from pallas_kernels.indexer import gpu_mosaic

        assert "_epiprobe" in lowers_for("cuda", "mosaic_gpu", lambda *a: indexer_scores_mosaic(
            *a, epilogue="probe", convert="raw"), q, w, keys, nv)
        saved = dict(gpu_mosaic.MOSAIC_CONFIG)
        try:
            gpu_mosaic.MOSAIC_CONFIG["epilogue"] = "probe"
            assert "_epiprobe" in lowers_for("cuda", "mosaic_gpu", lambda *a: indexer_topk_gpu(
                *a, k=64, kernel="mosaic", topk="segment_set"), q, w, keys, nv)
        finally:
            gpu_mosaic.MOSAIC_CONFIG.clear()
            gpu_mosaic.MOSAIC_CONFIG.update(saved)
        with pytest.raises(ValueError, match="epilogue must be one of"):
            indexer_scores_mosaic(q, w, keys, nv, epilogue="none")
    if not opts:   # the conversion-free timing probe (session 46), both precisions: no per-8-value asm left
        for precision, asm_line in (("f16", "mul.rn.f16x2 $0, a, $5"), ("fp8", "and.b32 m, $2, 0x77777777")):
            probe = lambda *a: indexer_scores_mosaic(*a, precision=precision, convert="raw")
            assert asm_line in lowers_for("cuda", "mosaic_gpu", lambda *a: indexer_scores_mosaic(
                *a, precision=precision), q, w, keys, nv)
            assert asm_line not in lowers_for("cuda", "mosaic_gpu", probe, q, w, keys, nv)
    with pytest.raises(ValueError, match="precision must be"):
        indexer_scores_mosaic(q, w, keys, nv, precision="bf16")
    with pytest.raises(ValueError, match="convert="):
        indexer_scores_mosaic(q, w, keys, nv, convert="alu")
    for precision in ("f16", "fp8"):   # the register path (the converter, default at "fp8", interprets)
        with pytest.raises(ValueError, match="interpret mode"):
            indexer_scores_mosaic(q, w, keys, nv, interpret=True, precision=precision, fp4_converter=0)


@pytest.mark.parametrize("B,S,H,T,opts", sweep([core(2, 1, 64, 296, {}),
                                                (3, 2, 16, 1000, dict(block_t=128, num_stages=2)),
                                                (1, 1, 128, 5000, dict(block_t=256, num_splits=3, num_stages=2)),
                                                (2, 1, 40, 296, dict(precision="bf16")),
                                                (2, 1, 64, 296, dict(split_m=True))]))
def test_indexer_mosaic_bf16_lowers(B, S, H, T, opts):
    """The Mosaic GPU indexer kernel over bf16 keys (session 27: TMA into bf16 wgmmas, q as bf16 hi + lo into one
    accumulator, or one bf16 term) lowers for CUDA, alone and under the threshold top-k."""
    from pallas_kernels.indexer.gpu import indexer_topk_gpu
    from pallas_kernels.indexer.gpu_mosaic import indexer_scores_mosaic

    q, w, keys, nv = make_indexer(B, S, H, T, "bf16")
    lowers_for("cuda", "mosaic_gpu", lambda *a: indexer_scores_mosaic(*a, **opts), q, w, keys, nv)
    lowers_for("cuda", "mosaic_gpu", lambda *a: indexer_topk_gpu(*a, k=64, kernel="mosaic", topk="threshold_set",
                                                                **opts), q, w, keys, nv)
    with pytest.raises(ValueError, match="precision must be one of \\('bf16x2', 'bf16'\\) for bf16 keys"):
        indexer_scores_mosaic(q, w, keys, nv, precision="f16")


@full_tier
def test_sparse_attention_mosaic_fp8_dequant_default(monkeypatch):
    """fp8_dequant=None takes DEFAULT_FP8_DEQUANT where it applies (FP8 pools, no option that needs the consumers
    to convert) and the consumers' own dequantization otherwise, so an explicit block_k=64, split_d=False or
    fp8_overlap keeps working whichever mode is the default; bf16 pools never build a tile ring."""
    from pallas_kernels.sparse_attention import gpu_mosaic

    monkeypatch.setattr(gpu_mosaic, "DEFAULT_FP8_DEQUANT", "converter")
    built = spy_mosaic_builds(monkeypatch)
    keys = ("q", "window_kv", "window_idx", "compressed_kv", "compressed_idx", "sinks")
    fp8 = [make_attention(2, 1, 64, 512, 300, 9000, 128, 512, ragged=True, fp8=True)[k] for k in keys]
    bf16 = [make_attention(2, 1, 64, 512, 300, 9000, 128, 512, ragged=True)[k] for k in keys]
    # FP8 prefill over 8320 index rows in one split: the default's tile ring does not fit next to them whole
    # (idx_stream=False: the consumers convert), streamed it does
    long = [make_attention(1, 64, 64, 512, 300, 9000, 128, 8192, ragged=True, fp8=True)[k] for k in keys]
    cases = [(fp8, {}, True), (fp8, dict(block_k=64), False), (fp8, dict(split_d=False), False),
             (fp8, dict(fp8_overlap=True), False), (fp8, dict(regs=(40, 232)), False), (bf16, {}, False),
             (long, dict(n_splits=1), True), (long, dict(n_splits=1, idx_stream=False), False)]
    for args, opts, conv in cases:
        lowers_for("cuda", "mosaic_gpu", lambda *a: gpu_mosaic.sparse_attention_mosaic(*a, scale=0.1, **opts), *args)
        assert built[-1]["conv"] is conv and not built[-1]["pdq"], (opts, built[-1])
        # the converter's own chunk order ("owned" since session 71), row-major where the consumers convert
        assert built[-1]["chunk_order"] == (gpu_mosaic.DEFAULT_FP8_CHUNK_ORDER["converter"] if conv else "rows"), \
            (opts, built[-1])
        # the lazy rescale of the output accumulator: the FP8 default (session 26), bf16 keeps the eager update
        assert built[-1]["lazy"] is (args is not bf16), (opts, built[-1])


@pytest.mark.parametrize("opts", [dict(finite_only=True, set_out=True), dict(), dict(chunk=8192, finite_only=True,
                                                                                     set_out=True)])
def test_hist_topk_lowers(opts):
    """The histogram top-k (`topk_hist`, Triton's tt.histogram through our lowering rule) for 64 x 32768 rows, one
    resident tile or four reloaded ones."""
    from pallas_kernels.indexer.topk_hist import hist_select

    s = jnp.zeros((64, 32768), jnp.float32)
    lowers_for("cuda", "topk_hist", lambda x: hist_select(x, 512, **opts), s)


@pytest.mark.parametrize("R,T,opts", [(64, 32768, dict(finite_only=True, set_out=True)), full(1, 262144, dict())])
def test_tournament_last_stage_lowers(R, T, opts):
    """The tournament with its last segment stage and final selection in one kernel (`fuse_final`: an arrival
    counter per row, zeroed by XLA and aliased into the kernel) lowers for CUDA: one stage before it at 262144."""
    from pallas_kernels.indexer.topk_hist import tournament_select

    s = jnp.zeros((R, T), jnp.float32)
    text = lowers_for("cuda", "topk_tour_last", lambda x: tournament_select(x, 512, fuse_final=True, **opts), s)
    assert ("topk_hist_segments" in text) == (T > 65536), T


@pytest.mark.parametrize("fmt,detail", [("fp4", False), ("fp4", True), full("fp8", False)])
def test_indexer_mosaic_profiled_build_lowers(fmt, detail, monkeypatch):
    """MOSAIC_CONFIG["profile"] (session 74, benchmarks/indexer_phase_profile.py): the segment top-k's kernel lowers
    with Mosaic GPU's profiler, every region of `PROFILE_REGIONS` it can reach recorded (and nothing else but
    Pallas' own "Init"), the profile space from the split's blocks; the interpreter refuses it; off, no profiler."""
    from jax.experimental.mosaic.gpu import profiler as mgpu_profiler

    from pallas_kernels.indexer import gpu_mosaic
    from pallas_kernels.indexer.gpu import indexer_topk_gpu

    names, spaces = set(), []
    real_intern, real_params = mgpu_profiler.ProfilerSpec.intern_name, gpu_mosaic.profile_params
    monkeypatch.setattr(mgpu_profiler.ProfilerSpec, "intern_name",
                        lambda self, n: names.add(n) or real_intern(self, n))

    def params(bps, interpret=False, **regions):   # the split's blocks and the profile space the kernel asks for
        got = real_params(bps, interpret, **regions)
        spaces.append((bps, got["compiler_params"].profile_space if got else None))
        return got

    monkeypatch.setattr(gpu_mosaic, "profile_params", params)
    # the trace's dump is a host callback, which cannot lower for CUDA on a CPU-only machine
    monkeypatch.setattr(jax.debug, "callback", lambda *a, **k: None)
    monkeypatch.setitem(gpu_mosaic.MOSAIC_CONFIG, "profile", "/tmp/unused_profile_dir")
    monkeypatch.setitem(gpu_mosaic.MOSAIC_CONFIG, "profile_detail", detail)
    q, w, keys, nv = make_indexer(2, 1, 64, 2048, fmt, True)

    def lower():   # -> the regions the kernel records, [(bps, the profile space it asks for)]
        names.clear()
        spaces.clear()
        lowers_for("cuda", "mosaic_gpu", lambda *a: indexer_topk_gpu(*a, k=64, kernel="mosaic", topk="segment_set"),
                   q, w, keys, nv)
        return names, spaces

    tables = [gpu_mosaic.PROFILE_REGIONS] + ([gpu_mosaic.PROFILE_DETAIL_REGIONS] if detail else [])
    regions = {r.split(" ")[0] for table in tables for role in table.values() for r in role}
    # fp8 keys: no converter, and the split_m default's halves carry no s_mma region
    expected = regions if fmt == "fp4" else {r for r in regions if r[0] == "s" and r != "s_mma"}
    expected.discard("c_refill")   # conv_sync "early" only (below)
    if fmt == "fp4" and detail:   # the detail regions take their ops out of these, which stay for the rest
        assert {"s_sync", "c_commit", "s_epilogue", "c_store"} <= expected
    got, ((bps, space),) = lower()
    assert got == expected | {"Init"}, got ^ (expected | {"Init"})
    assert space == (5 if detail else 4) * bps + gpu_mosaic.PROFILE_ONCE
    with pytest.raises(ValueError, match="interpreter"):
        gpu_mosaic.profile_params(4, interpret=True)
    if fmt == "fp4" and detail:   # conv_sync "early" (session 75): the converter's copies in a detail region more
        monkeypatch.setitem(gpu_mosaic.MOSAIC_CONFIG, "conv_sync", "early")
        got, ((bps, space),) = lower()
        assert got == expected | {"Init", "c_refill"}, got ^ (expected | {"Init", "c_refill"})
        assert space == 6 * bps + gpu_mosaic.PROFILE_ONCE
        # seg_hist "converter" (session 75): the histogram's regions move to the converter
        monkeypatch.setitem(gpu_mosaic.MOSAIC_CONFIG, "seg_hist", "converter")
        hist_regions = {r.split(" ")[0] for role in gpu_mosaic.PROFILE_HIST_REGIONS.values() for r in role}
        want = (expected - {"s_hist"}) | hist_regions | {"Init", "c_refill"}
        got, ((bps, space),) = lower()
        assert got == want, got ^ want
        assert space == 8 * bps + gpu_mosaic.PROFILE_ONCE
        # select_wgs 2 (session 76): the converter's share of the selection, once a CTA (no room a block)
        monkeypatch.setitem(gpu_mosaic.MOSAIC_CONFIG, "select_wgs", 2)
        want |= {r.split(" ")[0] for r in gpu_mosaic.PROFILE_SELECT_REGIONS["converter"]}
        got, ((bps, space),) = lower()
        assert got == want, got ^ want
        assert space == 8 * bps + gpu_mosaic.PROFILE_ONCE
    if fmt == "fp8":   # a converter option set globally asks for no room a kernel without the converter never uses
        monkeypatch.setitem(gpu_mosaic.MOSAIC_CONFIG, "seg_hist", "converter")
        monkeypatch.setitem(gpu_mosaic.MOSAIC_CONFIG, "conv_sync", "early")
        got, ((bps, space),) = lower()
        assert got == expected | {"Init"} and space == (5 if detail else 4) * bps + gpu_mosaic.PROFILE_ONCE
    monkeypatch.setitem(gpu_mosaic.MOSAIC_CONFIG, "profile", "")
    assert gpu_mosaic.profile_params(4) == {}
    got, _ = lower()
    assert not got


def test_indexer_mosaic_fused_q_prep_option(monkeypatch):
    """MOSAIC_CONFIG["q_prep"] = "fused" (session 76): on the default fp4 path (precision "fp8", the converter's rows
    layout, 64 heads) and on fp8 keys (either precision) the kernel ("_qf") makes q's operand itself and no Triton q
    kernel runs before it; elsewhere (the fragments layout, 16 or 32 heads) the Triton q kernel stays; other values
    are refused."""
    from pallas_kernels.indexer import gpu_mosaic
    from pallas_kernels.indexer.gpu import indexer_topk_gpu

    def lowered(H=64, fmt="fp4", **kw):   # -> (the scores kernels' names, whether a Triton q kernel is in the module)
        fn = lambda *a: indexer_topk_gpu(*a, k=64, kernel="mosaic", topk="segment_set", **kw)
        text = lowers_for("cuda", "mosaic_gpu", fn, *make_indexer(2, 1, H, 2048, fmt, True))
        return set(re.findall(r"indexer_scores_\w+", text)), "indexer_q_prep" in text

    names, q_kernel = lowered()
    assert not any("_qf" in n for n in names) and q_kernel, names
    monkeypatch.setitem(gpu_mosaic.MOSAIC_CONFIG, "q_prep", "fused")
    for kw, suffix in (({}, "_cv2_rows_qf"), (dict(fmt="fp8"), "_sel64_qf"),
                       (dict(fmt="fp8", precision="fp8"), "_sel64_qf")):
        names, q_kernel = lowered(**kw)
        assert any(n.endswith(suffix) for n in names) and not q_kernel, (kw, names)
    for kw, layout in ((dict(H=16), "auto"), (dict(fmt="fp8", H=32), "auto"), ({}, "fragments")):
        monkeypatch.setitem(gpu_mosaic.MOSAIC_CONFIG, "fp4_layout", layout)
        names, q_kernel = lowered(**kw)
        assert not any("_qf" in n for n in names) and q_kernel, (kw, layout, names)
    monkeypatch.setitem(gpu_mosaic.MOSAIC_CONFIG, "q_prep", "cuda")
    with pytest.raises(ValueError, match="q_prep"):
        lowered()


def test_indexer_mosaic_seg_sync_option(monkeypatch):
    """MOSAIC_CONFIG["seg_sync"] and ["conv_sync"] (session 74): the defaults ("barrier", "commit") keep the fp4
    converter kernel's name under the segment top-k; seg_sync "commit" (the code before) and conv_sync "arrive" and
    "early" (session 75) are kernels of their own names; other values are refused."""
    from pallas_kernels.indexer import gpu_mosaic
    from pallas_kernels.indexer.gpu import indexer_topk_gpu

    q, w, keys, nv = make_indexer(2, 1, 64, 2048, "fp4", True)
    # a new function per lowering: jit's trace cache does not see MOSAIC_CONFIG
    seg = lambda: lambda *a: indexer_topk_gpu(*a, k=64, kernel="mosaic", topk="segment_set")
    names = lambda text: set(re.findall(r"indexer_scores_fp4_\w+", text))
    default = names(lowers_for("cuda", "mosaic_gpu", seg(), q, w, keys, nv))
    assert any(n.endswith("_cv2_rows") for n in default) and not any("_segc" in n for n in default), default
    monkeypatch.setitem(gpu_mosaic.MOSAIC_CONFIG, "seg_sync", "commit")
    assert any("_cv2_rows_segc" in n for n in names(lowers_for("cuda", "mosaic_gpu", seg(), q, w, keys, nv)))
    monkeypatch.setitem(gpu_mosaic.MOSAIC_CONFIG, "seg_sync", "fence")
    with pytest.raises(ValueError, match="seg_sync"):
        seg()(q, w, keys, nv)
    # conv_sync (session 74): "commit" (the default) keeps the name, "arrive" is "_cva"; shared tables keep "commit"
    monkeypatch.setitem(gpu_mosaic.MOSAIC_CONFIG, "seg_sync", "barrier")
    monkeypatch.setitem(gpu_mosaic.MOSAIC_CONFIG, "conv_sync", "arrive")
    assert any(n.endswith("_cv2_rows_cva") for n in names(lowers_for("cuda", "mosaic_gpu", seg(), q, w, keys, nv)))
    monkeypatch.setitem(gpu_mosaic.MOSAIC_CONFIG, "conv_sync", "early")   # session 75
    assert any(n.endswith("_cv2_rows_cve") for n in names(lowers_for("cuda", "mosaic_gpu", seg(), q, w, keys, nv)))
    # seg_hist (session 75): "converter" is "_hcv" under the segment top-k; pruning keeps the scorer's histogram
    monkeypatch.setitem(gpu_mosaic.MOSAIC_CONFIG, "seg_hist", "converter")
    assert any(n.endswith("_cv2_rows_cve_hcv") for n in names(lowers_for("cuda", "mosaic_gpu", seg(), q, w, keys, nv)))
    # select_wgs (session 76): 2 is "_s2" with the converter's histogram and the plain selection; the "last" final
    # and pruning keep one warpgroup's selection (and pruning the scorer's histogram)
    monkeypatch.setitem(gpu_mosaic.MOSAIC_CONFIG, "select_wgs", 2)
    both = names(lowers_for("cuda", "mosaic_gpu", seg(), q, w, keys, nv))
    assert any(n.endswith("_cv2_rows_cve_hcv_s2") for n in both), both
    monkeypatch.setitem(gpu_mosaic.SELECT_CONFIG, "final", "cluster")
    clustered = names(lowers_for("cuda", "mosaic_gpu", seg(), q, w, keys, nv))
    assert any(n.endswith("_hcv") and "_cl" in n for n in clustered), clustered
    monkeypatch.setitem(gpu_mosaic.SELECT_CONFIG, "final", "triton")
    monkeypatch.setitem(gpu_mosaic.SELECT_CONFIG, "prune", 512)
    pruned = names(lowers_for("cuda", "mosaic_gpu", seg(), q, w, keys, nv))
    assert any("_pr512" in n for n in pruned) and not any("_hcv" in n or "_s2" in n for n in pruned), pruned
    monkeypatch.setitem(gpu_mosaic.SELECT_CONFIG, "prune", 0)
    monkeypatch.setitem(gpu_mosaic.MOSAIC_CONFIG, "select_wgs", 3)
    with pytest.raises(ValueError, match="select_wgs"):
        seg()(q, w, keys, nv)
    monkeypatch.setitem(gpu_mosaic.MOSAIC_CONFIG, "select_wgs", 1)
    monkeypatch.setitem(gpu_mosaic.MOSAIC_CONFIG, "seg_hist", "both")
    with pytest.raises(ValueError, match="seg_hist"):
        seg()(q, w, keys, nv)
    monkeypatch.setitem(gpu_mosaic.MOSAIC_CONFIG, "seg_hist", "scorer")
    monkeypatch.setitem(gpu_mosaic.MOSAIC_CONFIG, "fp4_tables", "shared")
    monkeypatch.setitem(gpu_mosaic.MOSAIC_CONFIG, "fp4_layout", "fragments")
    shared = names(lowers_for("cuda", "mosaic_gpu", seg(), q, w, keys, nv))
    assert any(n.endswith("_cv2_tsh") for n in shared), shared
    monkeypatch.setitem(gpu_mosaic.MOSAIC_CONFIG, "conv_sync", "none")
    with pytest.raises(ValueError, match="conv_sync"):
        seg()(q, w, keys, nv)
