"""Every Pallas TPU (Mosaic) kernel configuration lowers for a TPU target -- checked on CPU, no TPU needed.

The TPU interpreter (the CPU kernel tests) runs any jnp primitive on any block shape, but Pallas' Mosaic lowering
accepts only what Mosaic supports (block shapes tiled (8, 128), supported dtype casts, no unsupported gathers...).
`jit(...).trace(...).lower(lowering_platforms=("tpu",))` runs that lowering from a CPU-only machine, so such
failures show up in CI. Some lowering rules ask for the TPU generation (e.g. `sign` on v6e+); the CPU has none, so
a v6e (Trillium) TpuInfo is registered for the "cpu" device kind while these tests run. Mosaic's own compilation
(layout assignment, tiling rules, register allocation) happens in libtpu: tests/test_tpu_offline.py runs it for a
described v6e topology where libtpu is installed (session 50; not in CI)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from test_compressor_kernels import make as make_compressor
from test_gpu_lowering import lowers_for
from test_indexer_kernels import make as make_indexer
from test_sparse_attention import make_inputs as make_attention
from tiers import full


@pytest.fixture(autouse=True)
def _cpu_as_v6e(monkeypatch):
    from jax._src.pallas.mosaic import tpu_info

    monkeypatch.setitem(tpu_info.registry, jax.devices()[0].device_kind,
                        lambda: tpu_info.get_tpu_info_for_chip(tpu_info.ChipVersion.TPU_V6E, 1))


def lowers_for_tpu(fn, *args):
    lowers_for("tpu", "tpu_custom_call", fn, *args)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("t", [1, full(4)])
def test_sparse_attention_lowers_for_tpu(fp8, t):
    from pallas_kernels.sparse_attention.tpu import sparse_attention_tpu

    inp = make_attention(2, t, 64, 512, 300, 200, 128, 64, fp8=fp8, ragged=True)
    keys = ("q", "window_kv", "window_idx", "compressed_kv", "compressed_idx", "sinks")
    lens = dict(window_len=inp["window_len"], compressed_len=inp["compressed_len"])
    lowers_for_tpu(lambda *a: sparse_attention_tpu(*a, scale=512 ** -0.5, **lens), *(inp[k] for k in keys))


@pytest.mark.parametrize("fmt,rotate", [(None, False), ("bf16", False), ("fp8", True), ("fp4", True)])
@pytest.mark.parametrize("S", [1, full(19)])
def test_indexer_lowers_for_tpu(fmt, rotate, S):
    from pallas_kernels.indexer.tpu import indexer_topk_tpu

    q, w, keys, nv = make_indexer(2, S, 64, 300, fmt, rotate, causal=S > 1)
    lowers_for_tpu(lambda q, w, k, n: indexer_topk_tpu(q, w, k, n, k=64), q, w, keys, nv)


@pytest.mark.parametrize("r,overlap,d,fmt,S", [
    (4, True, 128, "fp4", 1), (4, True, 128, "fp8", 33), full(4, True, 128, "bf16", 9), (4, True, 512, None, 40),
    full(128, False, 512, None, 300), (128, False, 512, None, 1), (4, True, 512, "kv_fp8", 40),
    full(128, False, 512, "kv_fp8", 130)])
def test_compressor_lowers_for_tpu(r, overlap, d, fmt, S):
    from pallas_kernels.compressor.tpu import compress_chunk_tpu

    inp, kw = make_compressor(2, S, r, overlap, d, None if fmt == "kv_fp8" else fmt)
    if fmt == "kv_fp8":   # the main KV cache's 584-B FP8 rows
        from pallas_kernels.sparse_attention.fp8_layout import quantize_kv_fp8_rows

        inp["entries"], kw["key_format"] = quantize_kv_fp8_rows(inp["entries"]), "kv_fp8"
    keys = ("kv", "gate", "start", "n_valid", "state_kv", "state_gate", "prev_kv", "prev_gate", "entries")
    rotate = fmt in ("bf16", "fp8", "fp4")
    lowers_for_tpu(lambda *a: compress_chunk_tpu(*a, **kw, rotate=rotate), *(inp[k] for k in keys))


@pytest.mark.parametrize("M,E,K,N,dtype", [(96, 256, 4096, 2048, jnp.bfloat16), (20, 8, 64, 32, jnp.float32)])
def test_grouped_matmul_lowers_for_tpu(M, E, K, N, dtype):
    """The routed experts' grouped matmul on the TPU (megablox via `grouped_matmul.tpu`) lowers at a V4-Flash decode
    shape (96 token x expert rows, 256 experts, 4096 x 2048) and at the tiny f32 model's (its dot at precision
    "highest", the model's default on the TPU since session 46)."""
    from pallas_kernels.grouped_matmul import grouped_matmul_tpu

    lowers_for_tpu(grouped_matmul_tpu, jax.ShapeDtypeStruct((M, K), dtype), jax.ShapeDtypeStruct((E, K, N), dtype),
                   jax.ShapeDtypeStruct((E,), jnp.int32))


@pytest.mark.parametrize("M,E,K,N,dtype", [(96, 256, 4096, 2048, jnp.bfloat16), full(96, 256, 2048, 4096, jnp.bfloat16),
                                           full(4096, 64, 4096, 2048, jnp.bfloat16), (40, 8, 256, 128, jnp.float32)])
def test_grouped_matmul_fp4_lowers_for_tpu(M, E, K, N, dtype):
    """The FP4-weight grouped matmul on the TPU (`grouped_matmul.tpu.grouped_matmul_fp4_tpu`, session 48: the
    checkpoint's bytes decoded in VMEM) lowers at V4-Flash's w1 / w2 decode shapes, a prefill-sized call and the
    small f32 case of its interpreter test."""
    from pallas_kernels.grouped_matmul.fp4 import Fp4Weights
    from pallas_kernels.grouped_matmul.tpu import grouped_matmul_fp4_tpu

    sds = jax.ShapeDtypeStruct
    rhs = Fp4Weights(sds((E, N, K // 2), jnp.uint8), sds((E, N, K // 32), jnp.uint8))
    lowers_for_tpu(grouped_matmul_fp4_tpu, sds((M, K), dtype), rhs, sds((E,), jnp.int32))
