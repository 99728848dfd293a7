"""Sparse attention kernels vs the reference, on CPU: the GPU (Triton) kernel in the Pallas interpreter and the TPU
(Mosaic) kernel in the TPU interpreter. Shapes are tiny; every check draws fresh random inputs."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.sparse_attention import (
    dequantize_kv_fp8,
    from_packed_u8,
    quantize_kv_fp8,
    resolve_impl,
    sparse_attention,
    sparse_attention_reference,
    to_packed_u8,
)
from tiers import full, full_tier

_SEED = itertools.count(1000)


def make_inputs(b, t, h, d, n_w, n_c, k_w, k_c, *, fp8=False, ragged=False, all_invalid_c=False, dupes=False,
                oob=True, q_dtype=jnp.bfloat16, seed=None, wide_scales=False):
    """Fresh random inputs. Indices include -1 and (if oob) out-of-range rows; optional ragged lengths,
    all-invalid compressed lists for some queries, duplicated indices; wide_scales: each 64-column block of each KV
    row times its own power of two in [2^-12, 2^6] (FP8 pools: scale bytes over ~20 binades, not ~2)."""
    rng = np.random.default_rng(next(_SEED) if seed is None else seed)
    q = jnp.asarray(rng.standard_normal((b, t, h, d)) * 2.0, q_dtype)
    wkv = jnp.asarray(rng.standard_normal((n_w, d)), jnp.bfloat16)
    ckv = jnp.asarray(rng.standard_normal((n_c, d)), jnp.bfloat16)
    hi_w = n_w + (4 if oob else 0)
    hi_c = n_c + (4 if oob else 0)
    if wide_scales:
        blk = lambda n: jnp.asarray(np.repeat(np.exp2(rng.integers(-12, 7, (n, d // 64))), 64, axis=1), jnp.float32)
        wkv = (wkv.astype(jnp.float32) * blk(n_w)).astype(jnp.bfloat16)
        ckv = (ckv.astype(jnp.float32) * blk(n_c)).astype(jnp.bfloat16)
    wi = rng.integers(-1, hi_w, (b, t, k_w)).astype(np.int32)
    ci = rng.integers(-1, hi_c, (b, t, k_c)).astype(np.int32)
    wi[..., 0] = rng.integers(0, n_w, (b, t))  # most queries keep one valid window entry
    if dupes:
        ci[..., 1::3] = ci[..., 0:1]
        wi[..., -1] = wi[..., 0]
    if all_invalid_c:
        ci[0] = -1
        if b * t > 1:
            ci.reshape(b * t, k_c)[-1] = n_c + 7  # all out of range
    sinks = jnp.asarray(rng.standard_normal(h), jnp.float32)
    wl = cl = None
    if ragged:
        wl = jnp.asarray(rng.integers(0, k_w + 1, (b, t)), jnp.int32)
        cl = jnp.asarray(rng.integers(0, k_c + 3, (b, t)), jnp.int32)
    if fp8:
        wkv, ckv = quantize_kv_fp8(wkv), quantize_kv_fp8(ckv)
    return dict(q=q, window_kv=wkv, window_idx=jnp.asarray(wi), compressed_kv=ckv, compressed_idx=jnp.asarray(ci),
                sinks=sinks, window_len=wl, compressed_len=cl)


def opts_id(opts):
    """Test-id suffix naming a case's GPU kernel options (shared by the interpreted and the compiled kernel tests)."""
    return "".join([
        "_vec" if opts.get("fp8_scales") == "vector" else "", "_dc128" if opts.get("d_chunk") else "",
        {"f16": "_f16", "bf16": "_bf16ops"}.get(opts.get("fp8_operands"), ""), f"_cs{opts['col_splits']}" if "col_splits" in opts else "",
        f"_pf{opts['prefetch']}" if "prefetch" in opts else "", "_qr" if opts.get("q_reload") else "",
        f"_r{opts['regs'][0]}" if "regs" in opts else "",
        {True: "_ss", False: "_noss"}.get(opts.get("split_scores"), ""),
        f"_{opts['_diag']}" if "_diag" in opts else "", "_cpa" if opts.get("producer") == "cp_async" else "",
        f"_l2a{opts['l2_ahead']}" if "l2_ahead" in opts else "", f"_cmb{opts['combine']}" if "combine" in opts else "",
        f"_bk{opts['block_k']}x{opts.get('num_stages', 2)}" if "block_k" in opts else "",
        f"_sw{opts['store_wait']}" if "store_wait" in opts else "", {True: "_idxfirst", False: "_qfirst"}.get(opts.get("idx_first"), ""),
        "_pp" if opts.get("pingpong") else "", f"_cl{opts['cluster_loads']}" if "cluster_loads" in opts else "",
        "_sd" if opts.get("split_d") else "", f"_{opts['fp8_convert']}" if "fp8_convert" in opts else "",
        f"_st{opts['num_stages']}" if "num_stages" in opts and "block_k" not in opts else "",
        "_ovl" if opts.get("fp8_overlap") else "",
        {"producer": "_pdq", "converter": "_cvwg", "consumers": "_cons", "direct": "_direct"}.get(opts.get("fp8_dequant"), ""),
        f"_cu{opts['conv_units']}" if "conv_units" in opts else "",
        {"diagonal": "_dg", "owned": "_owned"}.get(opts.get("fp8_chunk_order"), ""),
        f"_ts{opts['tile_slots']}" if "tile_slots" in opts else "",
        f"_cb{opts['conv_batch']}" if "conv_batch" in opts else "", {True: "_lazy", False: "_eager"}.get(opts.get("lazy_rescale"), ""),
        {True: "_ist", False: "_noist"}.get(opts.get("idx_stream"), ""),
        {"registers": "_dsreg", "tile": "_dstile"}.get(opts.get("direct_staging"), ""),
        f"_pf{opts['direct_prefetch']}" if "direct_prefetch" in opts else "",
        {True: "_pcs", "rows": "_pcs", "pieces": "_pcsp"}.get(opts.get("piece_barriers"), ""),
        "_ahead" if opts.get("score_ahead") else "", f"_{opts['consumers']}" if "consumers" in opts else "",
        f"_copy{opts['fp8_copy']}" if "fp8_copy" in opts else "",
        f"_sc{opts['asym_scorer_cols']}" if "asym_scorer_cols" in opts else "",
        f"_qr{opts['asym_q_regs']}" if "asym_q_regs" in opts else ""])


def call(fn, inp, **kw):
    return fn(inp["q"], inp["window_kv"], inp["window_idx"], inp["compressed_kv"], inp["compressed_idx"],
              inp["sinks"], scale=inp["q"].shape[-1] ** -0.5, window_len=inp["window_len"],
              compressed_len=inp["compressed_len"], return_lse=True, **kw)


def check_close(out, ref, tol=2e-2):
    o, lse = out
    ro, rlse = ref
    o = np.asarray(o.astype(jnp.float32))
    ro = np.asarray(ro.astype(jnp.float32))
    assert not np.isnan(o).any(), "NaN in output (unwritten or bad masking)"
    assert not np.isnan(np.asarray(lse)).any(), "NaN in lse"
    err = np.linalg.norm(o - ro) / max(np.linalg.norm(ro), 1e-30)
    assert err < tol, f"relative error {err}"
    lse, rlse = np.asarray(lse), np.asarray(rlse)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(rlse))
    fin = np.isfinite(rlse)
    np.testing.assert_allclose(lse[fin], rlse[fin], atol=5e-2, rtol=1e-2)
    # queries with no valid entry: o == 0
    empty = np.isneginf(rlse)
    assert np.all(o[empty] == 0)


# --------------------------------------------------------------------------------------------- FP8 layout


def test_fp8_block_exponent_is_exact_at_powers_of_two():
    """s = 2^ceil(log2(amax / 448)) with amax = 448 x 2^k exactly (bf16 amax with mantissa 1.75: ~1 block in 128)
    is 2^k, not 2^(k+1): the exponent comes from the ratio's bits, not a float log2 (XLA's CPU log2 missed it)."""
    from pallas_kernels.sparse_attention.fp8_layout import block_exponent

    k = np.arange(-20, 20)
    amax = np.concatenate([448.0 * 2.0 ** k, np.nextafter(448.0 * 2.0 ** k, np.inf, dtype=np.float32),
                           np.nextafter(448.0 * 2.0 ** k, 0, dtype=np.float32), [0.0, 1e-9, 3e30]]).astype(np.float32)
    want = np.clip(np.ceil(np.log2(np.maximum(amax.astype(np.float64), 1e-4) / 448)), -127, 127)
    np.testing.assert_array_equal(np.asarray(block_exponent(jnp.asarray(amax))), want)


def test_fp8_roundtrip_and_packing():
    rng = np.random.default_rng(next(_SEED))
    x = jnp.asarray(rng.standard_normal((9, 512)) * np.exp(rng.uniform(-6, 6, (9, 1))), jnp.bfloat16)
    p = quantize_kv_fp8(x)
    assert p.nope.dtype == jnp.float8_e4m3fn and p.rope.dtype == jnp.bfloat16 and p.scale.dtype == jnp.uint8
    y = dequantize_kv_fp8(p)
    xf = np.asarray(x.astype(jnp.float32))
    np.testing.assert_array_equal(np.asarray(y[:, 448:]), xf[:, 448:])  # rope is exact
    rel = np.abs(np.asarray(y[:, :448]) - xf[:, :448]).max() / np.abs(xf[:, :448]).max()
    assert rel < 0.07
    # scale rule: s = 2^ceil(log2(amax/448)), byte = e + 127
    amax = np.maximum(np.abs(xf[:, :448]).reshape(9, 7, 64).max(-1), 1e-4)
    np.testing.assert_array_equal(np.asarray(p.scale[:, :7]).astype(int) - 127, np.ceil(np.log2(amax / 448)))
    packed = to_packed_u8(p)
    assert packed.shape == (9, 584) and packed.dtype == jnp.uint8
    p2 = from_packed_u8(packed)
    np.testing.assert_array_equal(np.asarray(dequantize_kv_fp8(p2)), np.asarray(y))
    # pytree: goes through jit
    y3 = jax.jit(dequantize_kv_fp8)(p)
    np.testing.assert_array_equal(np.asarray(y3), np.asarray(y))


@full_tier
def test_reference_accepts_fp8_pool():
    inp = make_inputs(2, 1, 4, 512, 16, 24, 6, 10, fp8=True)
    deq = dict(inp, window_kv=dequantize_kv_fp8(inp["window_kv"]), compressed_kv=dequantize_kv_fp8(inp["compressed_kv"]))
    a = call(sparse_attention_reference, inp)
    b = call(sparse_attention_reference, deq)
    np.testing.assert_allclose(np.asarray(a[0].astype(jnp.float32)), np.asarray(b[0].astype(jnp.float32)))


# --------------------------------------------------------------------------------------------- dispatcher


def test_dispatcher_impls():
    assert resolve_impl("auto") == "reference"  # CPU
    assert resolve_impl("pallas") == "interpret"
    with pytest.raises(ValueError, match="impl"):
        resolve_impl("cuda")
    inp = make_inputs(1, 2, 4, 128, 8, 8, 4, 4)
    a = call(sparse_attention, inp, impl="auto")
    b = call(sparse_attention_reference, inp)
    np.testing.assert_array_equal(np.asarray(a[0].astype(jnp.float32)), np.asarray(b[0].astype(jnp.float32)))


@pytest.mark.parametrize(
    "mutate, msg",
    [
        (lambda d: d.update(q=d["q"][0]), "q must be"),
        (lambda d: d.update(window_idx=d["window_idx"].astype(jnp.float32)), "window_idx must be an integer"),
        (lambda d: d.update(compressed_idx=None), "both be given"),
        (lambda d: d.update(sinks=d["sinks"][:2]), "sinks must be"),
        (lambda d: d.update(window_len=jnp.zeros((3,), jnp.int32)), "window_len must be"),
        (lambda d: d.update(compressed_kv=d["compressed_kv"][:, :64]), "head_dim"),
        (lambda d: d.update(window_idx=d["window_idx"][:1]), "window_idx must be"),
    ],
)
def test_validation_errors(mutate, msg):
    inp = make_inputs(2, 1, 4, 128, 8, 8, 4, 4)
    mutate(inp)
    with pytest.raises(ValueError, match=msg):
        call(sparse_attention, inp, impl="pallas")


# --------------------------------------------------------------------------------------------- GPU kernel, interpreted


GPU_CASES = [
    # (b, t, h, d, n_w, n_c, k_w, k_c, flags, kernel options)
    (2, 1, 4, 512, 24, 40, 8, 20, dict(fp8=False, ragged=True), dict(block_k=16, n_splits=1)),
    (2, 1, 4, 512, 24, 40, 8, 20, dict(fp8=True, ragged=True, dupes=True), dict(block_k=16, n_splits=3)),
    (1, 3, 64, 128, 16, 24, 8, 16, dict(all_invalid_c=True, dupes=True, q_dtype=jnp.float32), dict(block_k=16)),
    (1, 2, 128, 512, 16, 24, 4, 12, dict(fp8=True, all_invalid_c=True, ragged=True), dict(block_k=16, n_splits=2)),
    (2, 1, 16, 512, 24, 40, 8, 20, dict(fp8=True, ragged=True, dupes=True),
     dict(block_k=16, n_splits=3, fp8_scales="vector", partial_dtype=jnp.bfloat16)),
    # FP8 in 128-wide chunks (two scale blocks per chunk) with f16 operands, and with per-chunk scale gathers
    (2, 1, 16, 512, 24, 40, 8, 20, dict(fp8=True, ragged=True, dupes=True),
     dict(block_k=16, n_splits=2, d_chunk=128, fp8_operands="f16")),
    (1, 2, 4, 512, 16, 24, 4, 12, dict(fp8=True, all_invalid_c=True), dict(block_k=16, d_chunk=128,
                                                                          fp8_scales="per_chunk")),
    # output columns split over 2 / 4 programs (each recomputes the scores), with and without split-K
    (2, 1, 16, 512, 24, 40, 8, 20, dict(ragged=True, dupes=True), dict(block_k=16, n_splits=2, col_splits=2)),
    (2, 2, 4, 512, 24, 40, 8, 20, dict(fp8=True, ragged=True, all_invalid_c=True), dict(block_k=16, col_splits=4)),
    # manual prefetch of the next block's index list / rows (ragged ends, empty compressed lists, split-K)
    (2, 1, 16, 512, 24, 40, 8, 20, dict(ragged=True, dupes=True), dict(block_k=16, n_splits=2, prefetch="idx")),
    (2, 2, 4, 512, 24, 40, 8, 20, dict(fp8=True, ragged=True, all_invalid_c=True), dict(block_k=16, prefetch="rows")),
    # q reloaded in every step of the entry loop
    (2, 1, 16, 512, 24, 40, 8, 20, dict(fp8=True, ragged=True, dupes=True),
     dict(block_k=16, n_splits=2, q_reload=True)),
    # the split-K merge as one Pallas kernel (bf16 partials; an empty compressed list leaves splits empty)
    (2, 1, 16, 512, 24, 40, 8, 20, dict(ragged=True, all_invalid_c=True), dict(block_k=16, n_splits=3,
                                                                            combine="pallas")),
]


# the default tier: the first three cases (bf16 and FP8, split-K, 64 heads of 128, f32 q); the full tier every knob
@pytest.mark.parametrize("case", [c if i < 3 else full(c) for i, c in enumerate(GPU_CASES)],
                         ids=lambda c: f"h{c[2]}_d{c[3]}_{'fp8' if c[8].get('fp8') else 'bf16'}"
                         f"{opts_id(c[9])}{'_ns%d' % c[9]['n_splits'] if 'n_splits' in c[9] else ''}")
def test_gpu_kernel_interpret(case):
    b, t, h, d, n_w, n_c, k_w, k_c, flags, opts = case
    inp = make_inputs(b, t, h, d, n_w, n_c, k_w, k_c, **flags)
    out = call(sparse_attention, inp, impl="pallas", poison=True, **opts)
    ref = call(sparse_attention_reference, inp)
    assert out[0].dtype == inp["q"].dtype
    check_close(out, ref)


def test_fp8_pools_dequantized_first_in_interpreter():
    """fp8_pools="dequantize": the FP8 pools become bf16 once, then the bf16 kernel; the reference's result, and bit
    for bit the kernel's on pools dequantized by hand (the same bf16 operands)."""
    inp = make_inputs(1, 6, 4, 512, 24, 40, 8, 20, fp8=True, ragged=True, dupes=True, wide_scales=True)
    out = call(sparse_attention, inp, impl="pallas", fp8_pools="dequantize", block_k=16)
    check_close(out, call(sparse_attention_reference, inp))
    deq = dict(inp, window_kv=dequantize_kv_fp8(inp["window_kv"], jnp.bfloat16),
               compressed_kv=dequantize_kv_fp8(inp["compressed_kv"], jnp.bfloat16))
    by_hand = call(sparse_attention, deq, impl="pallas", block_k=16)
    np.testing.assert_array_equal(np.asarray(out[0].astype(jnp.float32)), np.asarray(by_hand[0].astype(jnp.float32)))
    with pytest.raises(ValueError, match="fp8_pools must be one of"):
        call(sparse_attention, inp, impl="reference", fp8_pools="bf16")


def test_dequantize_first_rule(monkeypatch):
    """fp8_pools="auto" dequantizes first on a GPU only, untuned, where the Mosaic kernel takes the bf16 pools and
    each pool row is gathered >= DEQUANT_MIN_REUSE times on average, the bf16 copy fitting DEQUANT_MAX_BYTES."""
    import pallas_kernels.sparse_attention as sa

    def decide(inp, **kw):
        return sa.dequantize_first(inp["q"], inp["window_kv"], inp["window_idx"], inp["compressed_kv"],
                                   inp["compressed_idx"], **kw)

    prefill = make_inputs(1, 64, 64, 512, 96, 40, 16, 24, fp8=True)    # 64 x 40 gathered over 136 rows: 18.8
    decode = make_inputs(4, 1, 64, 512, 96, 40, 16, 24, fp8=True)      # 4 x 40 over 136: 1.2
    bf16 = make_inputs(1, 64, 64, 512, 96, 40, 16, 24)
    assert decide(prefill) and decide(prefill, kernel="mosaic") and not decide(decode) and not decide(bf16)
    assert not decide(prefill, target="interpret") and not decide(prefill, target="tpu")
    assert not decide(prefill, kernel_options=dict(block_k=32))        # a tuned call keeps its kernel
    # only where the Mosaic kernel takes the bf16 pools (the measured case)
    assert not decide(prefill, kernel="triton") and not decide(prefill, out_dtype=jnp.float32)
    assert not decide(dict(prefill, q=prefill["q"].astype(jnp.float32)))
    assert not decide(dict(prefill, q=prefill["q"][:, :, :16]))
    assert decide(dict(prefill, q=prefill["q"][:, :, :16]), mode="dequantize")
    assert not decide(prefill, mode="kernel") and decide(decode, mode="dequantize")
    assert not decide(bf16, mode="dequantize")                          # nothing to dequantize
    window_only = dict(prefill, compressed_kv=None, compressed_idx=None)
    assert decide(window_only)                                          # 64 x 16 over 96 rows: 10.7
    monkeypatch.setattr(sa, "DEQUANT_MIN_REUSE", 20)
    assert not decide(prefill)
    monkeypatch.setattr(sa, "DEQUANT_MIN_REUSE", 4)
    monkeypatch.setattr(sa, "DEQUANT_MAX_BYTES", 136 * 512 * 2 - 1)     # one byte short of the bf16 pools
    assert not decide(prefill)
    with pytest.raises(ValueError, match="fp8_pools must be one of"):
        decide(prefill, mode="yes")


def test_gpu_kernel_option_errors():
    inp = make_inputs(2, 1, 4, 512, 24, 40, 8, 20, fp8=True)
    with pytest.raises(ValueError, match="d_chunk 64 or 128"):
        call(sparse_attention, inp, impl="pallas", d_chunk=256)
    with pytest.raises(ValueError, match="fp8_operands"):
        call(sparse_attention, inp, impl="pallas", fp8_operands="f32")
    with pytest.raises(ValueError, match="col_splits 3"):
        call(sparse_attention, inp, impl="pallas", col_splits=3)
    with pytest.raises(ValueError, match="col_splits 16"):  # 32-wide ranges cut the 64-wide FP8 chunks
        call(sparse_attention, inp, impl="pallas", col_splits=16)
    with pytest.raises(ValueError, match="prefetch"):
        call(sparse_attention, inp, impl="pallas", prefetch="kv")
    with pytest.raises(ValueError, match="combine must be one of"):
        call(sparse_attention, inp, impl="pallas", n_splits=1, combine="cub")


def test_gpu_kernel_interpret_sliding_only_f32_out():
    inp = make_inputs(2, 2, 4, 128, 20, 1, 8, 1)
    inp.update(compressed_kv=None, compressed_idx=None)
    out = call(sparse_attention, inp, impl="pallas", out_dtype=jnp.float32, block_k=16)
    ref = call(sparse_attention_reference, inp, out_dtype=jnp.float32)
    assert out[0].dtype == jnp.float32
    check_close(out, ref)


# --------------------------------------------------------------------------------------------- TPU kernel, interpreted


TPU_CASES = [
    (2, 1, 4, 512, 24, 40, 8, 20, dict(fp8=False, ragged=True, dupes=True)),
    (1, 2, 64, 512, 16, 24, 8, 12, dict(fp8=True, all_invalid_c=True, ragged=True)),
    (1, 1, 128, 512, 16, 24, 8, 8, dict(fp8=False, all_invalid_c=True)),
    # pool row counts that are no multiple of the 32-bit word's 2 / 4 rows (the word-row views pad them)
    (1, 1, 4, 512, 23, 37, 8, 16, dict(fp8=True, ragged=True)),
]


@pytest.mark.parametrize("case,double_buffer",
                         [(c, True) if i == 0 else full(c, True) for i, c in enumerate(TPU_CASES)]
                         + [full(TPU_CASES[0], False), full(TPU_CASES[1], False)],
                         ids=lambda c: f"h{c[2]}_{'fp8' if c[8].get('fp8') else 'bf16'}" if isinstance(c, tuple)
                         else ("ring2" if c else "ring1"))
def test_tpu_kernel_interpret(case, double_buffer):
    """The TPU kernel in the TPU interpreter == the reference: ragged lengths, duplicate indices, all-invalid
    compressed lists, 4 / 64 / 128 heads, bf16 and FP8 pools; with the two-slot gather ring (the default) and
    without it."""
    from pallas_kernels.sparse_attention.tpu import sparse_attention_tpu

    b, t, h, d, n_w, n_c, k_w, k_c, flags = case
    inp = make_inputs(b, t, h, d, n_w, n_c, k_w, k_c, **flags)
    out = call(sparse_attention_tpu, inp, interpret=True, block_k=8, double_buffer=double_buffer)
    ref = call(sparse_attention_reference, inp)
    check_close(out, ref)


def test_tpu_kernel_splits_calls_at_the_smem_budget(monkeypatch):
    """Index lists beyond the SMEM budget (scalar prefetch; libtpu refused 2 MiB) run as several calls over groups
    of query rows: with a budget of 2 rows' lists, 3 calls of 2, 2 and 1 rows, still the reference's output."""
    from pallas_kernels.sparse_attention import tpu
    from pallas_kernels.sparse_attention.tpu import sparse_attention_tpu

    inp = make_inputs(5, 1, 4, 512, 24, 40, 8, 16, fp8=True, ragged=True)
    per_row = 4 * (8 + 16 + 2)
    monkeypatch.setattr(tpu, "SMEM_INDEX_BUDGET", 2 * per_row + 3)
    calls = []
    real = tpu.pl.pallas_call
    monkeypatch.setattr(tpu.pl, "pallas_call", lambda *a, **k: calls.append(k["grid_spec"].grid) or real(*a, **k))
    out = call(sparse_attention_tpu, inp, interpret=True, block_k=8)
    assert [g[0] for g in calls] == [2, 2, 1]
    check_close(out, call(sparse_attention_reference, inp))


def test_tpu_word_row_unpacking_is_exact():
    """The TPU kernel's row gather fetches 32-bit word rows (`tpu._word_rows`' packing: pack consecutive rows a
    word, the first in the low bits) and `tpu._unpack` shifts the wanted row out: every row of bf16, e4m3 (all
    254 non-NaN codes), uint8 and f32 arrays comes back exactly; f16 pools are refused with a clear error (Mosaic
    TPU kernels take no f16 arguments)."""
    from pallas_kernels.sparse_attention.tpu import _pack, _unpack, _word_rows

    rng = np.random.default_rng(50)
    codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8)
    arrays = [jnp.asarray(rng.standard_normal((12, 40)), jnp.bfloat16),
              jax.lax.bitcast_convert_type(jnp.asarray(rng.choice(codes, (16, 24)), jnp.uint8), jnp.float8_e4m3fn),
              jnp.asarray(rng.integers(0, 256, (8, 8)), jnp.uint8),
              jnp.asarray(rng.standard_normal((6, 16)), jnp.float32)]
    arrays[1] = arrays[1].at[:2].set(jax.lax.bitcast_convert_type(jnp.asarray(codes[:48].reshape(2, 24)),
                                                                  jnp.float8_e4m3fn))   # every code, subnormals too
    for a in arrays:
        pack = _pack(a.dtype)
        words = _word_rows(a)
        rows = np.arange(a.shape[0])
        got = _unpack(words[rows // pack], jnp.asarray(((rows % pack) * (32 // pack))[:, None], jnp.uint32), a.dtype)
        want = a.astype(jnp.int32) if a.dtype == jnp.uint8 else a.astype(jnp.float32)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=str(a.dtype))
    from pallas_kernels.sparse_attention.tpu import sparse_attention_tpu

    inp = make_inputs(1, 1, 4, 128, 16, 16, 8, 8)
    inp["window_kv"], inp["compressed_kv"] = inp["window_kv"].astype(jnp.float16), inp["compressed_kv"].astype(jnp.float16)
    with pytest.raises(ValueError, match="takes bf16, float32 or Fp8KVPool pools"):
        call(sparse_attention_tpu, inp, interpret=True)


def test_kernel_option_validation():
    """`kernel` picks the GPU kernel: bad values and "mosaic" off the GPU fail loudly; on CPU "auto"/"triton" run
    the Triton kernel in the interpreter (the Mosaic GPU kernel has no interpreter)."""
    from pallas_kernels.sparse_attention import mosaic_applies

    inp = make_inputs(1, 1, 64, 128, 40, 30, 16, 8)
    with pytest.raises(ValueError, match="kernel must be one of"):
        call(sparse_attention, inp, impl="pallas", kernel="cuda")
    if jax.default_backend() == "cpu":
        with pytest.raises(ValueError, match="runs only on a GPU"):
            call(sparse_attention, inp, impl="pallas", kernel="mosaic")
        check_close(call(sparse_attention, inp, impl="pallas", kernel="triton"), call(sparse_attention_reference, inp))
    # what "auto" would pick on a GPU: bf16 q with 64 heads and bf16 pools, no Triton-only knob, bf16 output
    assert mosaic_applies(inp["q"], inp["window_kv"], inp["compressed_kv"])
    assert not mosaic_applies(inp["q"], inp["window_kv"], inp["compressed_kv"], out_dtype=jnp.float32)
    assert not mosaic_applies(inp["q"], inp["window_kv"], inp["compressed_kv"], kernel_options=dict(d_chunk=64))
    assert not mosaic_applies(inp["q"].astype(jnp.float32), inp["window_kv"], inp["compressed_kv"])
    assert not mosaic_applies(inp["q"][:, :, :16], inp["window_kv"], inp["compressed_kv"])
    q128 = jnp.concatenate([inp["q"], inp["q"]], axis=2)        # 128 heads: two CTAs of 64 per query row
    assert mosaic_applies(q128, inp["window_kv"], inp["compressed_kv"])
    assert not mosaic_applies(q128[:, :, :96], inp["window_kv"], inp["compressed_kv"])


def test_mosaic_only_knobs_with_auto_kernel_say_where_they_run():
    """kernel="auto" with a knob only the Mosaic GPU kernel has (cluster_loads, store_wait, ...) means that kernel:
    in the interpreter it is a clear error, not a TypeError from the Triton kernel."""
    from pallas_kernels.sparse_attention import mosaic_only_options, sparse_attention

    assert {"cluster_loads", "store_wait", "idx_first", "split_scores"} <= mosaic_only_options()
    assert not {"block_k", "num_stages", "n_splits", "combine"} & mosaic_only_options()
    inp = make_inputs(1, 1, 4, 512, 40, 80, 16, 16)
    with pytest.raises(ValueError, match="Mosaic GPU kernel's, which runs only on a GPU"):
        call(sparse_attention, inp, impl="pallas", cluster_loads="early")


@full_tier
def test_mosaic_kernel_input_errors():
    """The Mosaic GPU kernel's wrapper refuses what it cannot run, with a reason, before building anything (so this
    runs on CPU): mixed bf16 / FP8 pools, FP8 pools with a block_k other than 64 (or 32 with the tile ring), shared
    memory over budget with an explicit n_splits, register splits that do not fit the SM. "auto" picks it for FP8
    pools (both FP8, block_k 64, or 32 with the tile ring; session 19), not for mixed ones."""
    from pallas_kernels.sparse_attention import Fp8KVPool, mosaic_applies
    from pallas_kernels.sparse_attention.gpu_mosaic import sparse_attention_mosaic

    inp = make_inputs(2, 1, 64, 512, 300, 9000, 128, 8192, fp8=True)
    keys = ("q", "window_kv", "window_idx", "compressed_kv", "compressed_idx", "sinks")
    args = [inp[k] for k in keys]
    assert isinstance(args[1], Fp8KVPool)
    assert mosaic_applies(inp["q"], inp["window_kv"], inp["compressed_kv"])
    # block_k 32 is the FP8 tile ring's (the converter, the default since session 25), not the consumers'
    assert mosaic_applies(inp["q"], inp["window_kv"], inp["compressed_kv"], kernel_options=dict(block_k=32))
    assert not mosaic_applies(inp["q"], inp["window_kv"], inp["compressed_kv"],
                              kernel_options=dict(block_k=32, fp8_dequant="consumers"))
    assert not mosaic_applies(inp["q"], inp["window_kv"], inp["compressed_kv"], kernel_options=dict(block_k=128))
    assert not mosaic_applies(inp["q"], inp["window_kv"], inp["compressed_kv"], kernel_options=dict(split_scores=True))
    assert mosaic_applies(inp["q"], inp["window_kv"], inp["compressed_kv"], kernel_options=dict(num_stages=2))
    mixed = list(args)
    mixed[3] = jnp.zeros((64, 512), jnp.bfloat16)
    assert not mosaic_applies(inp["q"], inp["window_kv"], mixed[3])
    with pytest.raises(ValueError, match="both pools bf16 or both FP8"):
        sparse_attention_mosaic(*mixed, scale=0.1)
    # (96, 208) and (64, 224) add up to 512, over the 504 a 384-thread CTA starts with: setmaxnreg would hang
    for regs in ((56, 232), (60, 224), (16, 248), (176, 168), (96, 208), (64, 224)):
        with pytest.raises(ValueError, match="regs must be"):
            sparse_attention_mosaic(*args, scale=0.1, regs=regs)
    with pytest.raises(ValueError, match="block_k=64"):
        sparse_attention_mosaic(*args, scale=0.1, block_k=128)
    with pytest.raises(ValueError, match="shared memory .* over"):
        # 8320 index rows of one CTA held whole next to two 64-row staging slots where the consumers convert (their
        # default, one slot with split_d, fits; so do the rows streamed, idx_stream's default here)
        sparse_attention_mosaic(*args, scale=0.1, n_splits=1, num_stages=2, fp8_dequant="consumers",
                                idx_stream=False)
    with pytest.raises(ValueError, match="shared memory .* over"):
        # ... and next to the converter's three bf16 tiles (an explicit tile ring: no fallback to the consumers)
        sparse_attention_mosaic(*args, scale=0.1, n_splits=1, num_stages=2, tile_slots=3, idx_stream=False)
    with pytest.raises(ValueError, match="producer='cp_async' gathers bf16 rows"):
        sparse_attention_mosaic(*args, scale=0.1, producer="cp_async")
    bf = make_inputs(2, 1, 64, 512, 300, 900, 128, 512)
    for bk in (16, 96):   # 32 (bf16 pools, 64 B swizzle) or a multiple of 64
        with pytest.raises(ValueError, match="block_k must be a multiple of 64 and <= 256 \\(or 32"):
            sparse_attention_mosaic(*[bf[k] for k in keys], scale=0.1, block_k=bk)
    with pytest.raises(ValueError, match="l2_ahead must be in"):
        sparse_attention_mosaic(*args, scale=0.1, l2_ahead=9)
    with pytest.raises(ValueError, match="producer must be 'tma' or 'cp_async'"):
        sparse_attention_mosaic(*args, scale=0.1, producer="ldg")
    q96 = jnp.concatenate([args[0], args[0][:, :, :32]], axis=2)
    with pytest.raises(ValueError, match="multiple of 64 heads"):
        sparse_attention_mosaic(q96, *args[1:5], jnp.zeros((96,), jnp.float32), scale=0.1)


@pytest.mark.parametrize("n_splits,heads,dtype", [(1, 4, jnp.float32), (3, 8, jnp.bfloat16),
                                                  full(5, 64, jnp.bfloat16), full(2, 24, jnp.float32)])
def test_combine_splits_pallas_matches_xla(n_splits, heads, dtype):
    """The one-kernel split-K merge (Pallas interpreter) equals `common.combine_splits` on fresh partials, with
    empty splits (lse -inf, garbage partials) and a row whose splits are all empty; head blocks of 8 or fewer."""
    from pallas_kernels.sparse_attention.combine import combine_splits_pallas
    from pallas_kernels.sparse_attention.common import combine_splits

    rng = np.random.default_rng(100 + n_splits)
    n, d = 3, 128
    o_parts = jnp.asarray(rng.normal(size=(n, n_splits, heads, d)) * 3, dtype)
    lse = rng.normal(size=(n, n_splits, heads)) * 4
    lse[1, -1] = -np.inf                       # row 1's last split is empty
    lse[2] = -np.inf                           # row 2 saw no entry at all: o = 0, lse = -inf
    lse, sinks = jnp.asarray(lse, jnp.float32), jnp.asarray(rng.normal(size=heads), jnp.float32)
    o, lse_all = combine_splits_pallas(o_parts, lse, sinks, dtype, interpret=True)
    o_x, lse_x = combine_splits(o_parts, lse, sinks, dtype)
    assert o.dtype == dtype and o.shape == (n, heads, d)
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(o_x, np.float32), rtol=tol, atol=tol)
    np.testing.assert_allclose(np.asarray(lse_all), np.asarray(lse_x), rtol=1e-6)
    assert not np.asarray(o[2], np.float32).any() and np.isneginf(np.asarray(lse_all[2])).all()


def test_combine_splits_pallas_errors():
    from pallas_kernels.sparse_attention.combine import combine_splits_pallas

    o, lse, sk = jnp.zeros((2, 3, 8, 96)), jnp.zeros((2, 3, 8)), jnp.zeros((8,))
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        combine_splits_pallas(o, lse, sk, jnp.float32, interpret=True)
    with pytest.raises(ValueError, match="lse_parts must be"):
        combine_splits_pallas(jnp.zeros((2, 3, 8, 64)), jnp.zeros((2, 2, 8)), sk, jnp.float32, interpret=True)
    with pytest.raises(ValueError, match="heads_per_block"):
        combine_splits_pallas(jnp.zeros((2, 3, 8, 64)), lse, sk, jnp.float32, heads_per_block=3, interpret=True)


@pytest.mark.parametrize("n_splits", [1, 2, 5])
def test_combine_splits_matches_one_softmax(n_splits):
    """Split-K partials (each normalised by its own sum, with its log-sum-exp) merge into the softmax over all the
    splits' entries plus the sink; an empty split (lse -inf, any o) contributes nothing; bf16 partials are taken as
    stored."""
    from pallas_kernels.sparse_attention.common import combine_splits

    rng = np.random.default_rng(n_splits)
    bt, h, d, per = 3, 4, 8, 6
    logits = rng.normal(size=(bt, n_splits, h, per)) * 2
    v = rng.normal(size=(bt, n_splits, per, d))
    sinks = rng.normal(size=h)
    if n_splits > 1:
        logits[1, -1] = -np.inf                       # row 1's last split saw no entry
    with np.errstate(invalid="ignore", divide="ignore"):
        lse = np.log(np.exp(logits).sum(-1))           # [bt, S, H]
        p = np.exp(logits - lse[..., None])
    o_parts = np.nan_to_num(np.einsum("bshk,bskd->bshd", p, v), nan=7.0)   # garbage where the split is empty
    o, lse_all = combine_splits(jnp.asarray(o_parts, jnp.float32), jnp.asarray(lse, jnp.float32),
                                jnp.asarray(sinks, jnp.float32), jnp.float32)
    flat = logits.transpose(0, 2, 1, 3).reshape(bt, h, -1)
    vv = np.broadcast_to(v[:, None], (bt, h) + v.shape[1:]).reshape(bt, h, -1, d)
    den = np.exp(flat).sum(-1) + np.exp(sinks)
    want = np.einsum("bhk,bhkd->bhd", np.exp(flat), vv) / den[..., None]
    np.testing.assert_allclose(np.asarray(o), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse_all), np.log(np.exp(flat).sum(-1)), rtol=1e-5)
    o16, _ = combine_splits(jnp.asarray(o_parts, jnp.bfloat16), jnp.asarray(lse, jnp.float32),
                            jnp.asarray(sinks, jnp.float32), jnp.bfloat16)
    np.testing.assert_allclose(np.asarray(o16, np.float32), want, rtol=2e-2, atol=2e-2)
