"""Fused compressor kernels vs `compress_chunk` (the jnp reference), on CPU: the GPU (Triton) kernel in the Pallas
interpreter (impl="pallas" on CPU) and the TPU (Mosaic) kernel in the TPU interpreter (impl="interpret_tpu").
Tiny shapes, fresh random inputs per check, every window offset, ragged lengths, all entry formats. The
`test_gpu_*` tests run the compiled kernel and skip without a GPU."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.compressor import compress_chunk, resolve_impl
from pallas_kernels.indexer import formats as F
from tiers import full, full_tier

_SEED = itertools.count(7000)
INV_FREQ = tuple(1.0 / (10000.0 ** (np.arange(0, 64, 2) / 64)))
ON_GPU = jax.default_backend() == "gpu"
INTERP = ["pallas", "interpret_tpu"]


def make(B, S, r, overlap, d, fmt, ndt=jnp.float32, starts=None, n_valid=None, cap=None, fresh=False):
    rng = np.random.default_rng(next(_SEED))
    c = 2 if overlap else 1
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    start = np.asarray(starts if starts is not None else rng.integers(0, 3 * r, B), np.int32)
    nv = np.asarray(n_valid if n_valid is not None else rng.integers(0, S + 1, B), np.int32)
    cap = cap or (int(start.max()) + S) // r + 1
    inp = dict(kv=f(B, S, c * d), gate=f(B, S, c * d) * 2.0, start=jnp.asarray(start), n_valid=jnp.asarray(nv),
               state_kv=f(B, r, c * d), state_gate=f(B, r, c * d), prev_kv=None, prev_gate=None,
               entries=F.quantize(f(B, cap, d) * 3.0, fmt, ndt))
    if overlap:
        inp["prev_kv"] = f(B, r, d)
        inp["prev_gate"] = jnp.full((B, r, d), -jnp.inf, jnp.float32) if fresh else f(B, r, d)
    kw = dict(ratio=r, overlap=overlap, norm_weight=jnp.asarray(1.0 + 0.3 * rng.standard_normal(d), jnp.float32),
              eps=1e-6, inv_freq=INV_FREQ, norm_dtype=ndt, key_format=fmt)
    return inp, kw


def call(inp, kw, **extra):
    """compress_chunk on `inp` under one jit (an eager reference compiles op by op: slow on CPU)."""
    keys = ("kv", "gate", "start", "n_valid", "state_kv", "state_gate", "prev_kv", "prev_gate", "entries")
    static = {k: v for k, v in kw.items() if k != "norm_weight"}
    f = jax.jit(lambda a, nw: compress_chunk(*(a[k] for k in keys), norm_weight=nw, **static, **extra))
    return f({k: inp[k] for k in keys}, kw["norm_weight"])


def check(inp, kw, impl, tol=0.0, **extra):
    out = call(inp, kw, impl=impl, **extra)
    ref = call(inp, kw, impl="reference", **extra)
    e, er = np.asarray(F.dequantize(out[0])), np.asarray(F.dequantize(ref[0]))
    e0 = np.asarray(F.dequantize(inp["entries"]))
    assert not np.isnan(e).any()
    written = np.any(er != e0, axis=-1)
    np.testing.assert_array_equal(np.any(e != e0, axis=-1), written)   # same rows written, others untouched
    if written.any():
        err = np.linalg.norm(e[written] - er[written]) / np.linalg.norm(er[written])
        assert err <= tol, err
    for a, b_ in zip(out[1:], ref[1:]):
        if b_ is not None:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b_))
    if isinstance(out[0], F.QuantizedKeys):
        assert out[0].values.dtype == inp["entries"].values.dtype and out[0].scale.dtype == inp["entries"].scale.dtype
    return int(written.sum())


# tolerance: f32 pooling order differs from the reference -> tiny; quantized formats may flip a rounding bucket
TOL = {None: 1e-5, "bf16": 1e-2, "fp8": 3e-2, "fp4": 1e-1}


@pytest.mark.parametrize("impl,fmt,rotate", [full("pallas", None, False), full("pallas", "bf16", True),
                                             ("pallas", "fp8", True),
                                             ("pallas", "fp4", True), full("pallas", "fp4", False),
                                             full("interpret_tpu", None, False), ("interpret_tpu", "fp8", True),
                                             full("interpret_tpu", "fp4", False)])
def test_indexer_compressor_prefill_every_offset(impl, fmt, rotate):
    """ratio 4 overlap, d = 128: chunk of 9 tokens at window offsets 0..3 (rows), ragged n_valid incl. 0 and S."""
    inp, kw = make(4, 9, 4, True, 128, fmt, starts=[0, 5, 10, 15], n_valid=[9, 0, 6, 9])
    assert check(inp, kw, impl, TOL[fmt], rotate=rotate) > 0


@pytest.mark.parametrize("wb", [3, full(1), full(16)])
def test_tpu_windows_per_block(wb):
    """The TPU kernel finishing `windows_per_block` windows a grid step (padding windows past the grid are never
    written): a 30-token chunk at window offsets 0..3, ragged n_valid, fp8 indexer keys with the rotation."""
    inp, kw = make(4, 30, 4, True, 128, "fp8", starts=[0, 5, 10, 15], n_valid=[30, 0, 17, 29])
    assert check(inp, kw, "interpret_tpu", TOL["fp8"], rotate=True, windows_per_block=wb) > 0
    with pytest.raises(ValueError, match="windows_per_block must be >= 1"):
        call(inp, kw, impl="interpret_tpu", windows_per_block=-1)


@pytest.mark.parametrize("impl", ["pallas", full("interpret_tpu")])
def test_decode_every_offset_fresh_and_overlap(impl):
    """S = 1 decode at every offset of the window (0 or 1 entry per row), fresh prev state (-inf) for row 0."""
    inp, kw = make(8, 1, 4, True, 128, "fp8", starts=[3, 0, 1, 2, 3, 7, 11, 6], n_valid=[1] * 7 + [0], fresh=True)
    assert check(inp, kw, impl, TOL["fp8"], rotate=True) >= 2


@pytest.mark.parametrize("impl", ["pallas", full("interpret_tpu")])
def test_main_csa_bf16_model_dtype(impl):
    """main CSA compressor: d = 512, ratio 4 overlap, bf16 norm dtype and cache."""
    inp, kw = make(2, 12, 4, True, 512, None, ndt=jnp.bfloat16, starts=[2, 8])
    check(inp, kw, impl, TOL["bf16"])


@full_tier
@pytest.mark.parametrize("fmt", ["fp8"])
def test_two_pass_scratch_in_norm_dtype_is_exact(fmt):
    """Two-pass with a bf16 norm dtype keeps its pass-1 scratch in bf16 (half the round trip's bytes): the pooled
    values are rounded to bf16 before the store, so the result is bitwise the float32 scratch's. A scratch narrower
    than norm_dtype is refused."""
    inp, kw = make(2, 24, 4, True, 128, fmt, ndt=jnp.bfloat16, starts=[3, 6], n_valid=[24, 13])
    kw = dict(kw, rotate=fmt is not None)
    opts = dict(two_pass=True, windows_per_block=2, dc=32)
    narrow = call(inp, kw, impl="pallas", **opts)
    wide = call(inp, kw, impl="pallas", scratch_dtype=jnp.float32, **opts)
    for a, b_ in zip(jax.tree_util.tree_leaves(narrow), jax.tree_util.tree_leaves(wide)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b_))
    assert check(inp, kw, "pallas", TOL[fmt or "bf16"], **opts) > 0
    inp, kw = make(1, 40, 4, True, 128, None, starts=[0], n_valid=[40])
    with pytest.raises(ValueError, match="scratch_dtype must be float32 or norm_dtype"):
        call(inp, kw, impl="pallas", scratch_dtype=jnp.bfloat16, **opts)


def test_finish_options_validated():
    """Pass 2's own block / chunk sizes need the two-pass layout, powers of two and whole rope chunks."""
    inp, kw = make(1, 40, 4, True, 128, "fp8", starts=[0], n_valid=[40])
    for opts, msg in ((dict(two_pass=False, finish_windows_per_block=4), "apply to the two-pass layout"),
                      (dict(two_pass=True, finish_dc=48), "finish_dc must be a power of two"),
                      (dict(two_pass=True, finish_dc=128), "finish_dc 128 must divide")):
        with pytest.raises(ValueError, match=msg):
            call(inp, kw, impl="pallas", rotate=True, **opts)


@pytest.mark.parametrize("impl", ["pallas", full("interpret_tpu")])
def test_hca_ratio128(impl):
    """ratio 128 without overlap, d = 128: offsets 0, 1, 127 and a chunk that closes two windows; S = 1 decode."""
    inp, kw = make(3, 260, 128, False, 128, None, starts=[0, 1, 127], n_valid=[256, 255, 260])
    assert check(inp, kw, impl, TOL[None]) >= 4
    inp, kw = make(3, 1, 128, False, 128, "bf16", starts=[127, 255, 5], n_valid=[1, 1, 1])
    assert check(inp, kw, impl, TOL["bf16"]) == 2


@pytest.mark.parametrize("r,overlap,fmt,rotate,opts", [
    # several windows per block, slots in 2 sub-blocks (online softmax), fused layout
    full(4, True, "fp8", True, dict(windows_per_block=4, slot_block=2, two_pass=False)),
    # two-pass, 2-window blocks, 32-wide channel chunks (Hadamard butterflies across 4 chunks)
    full(4, True, "fp4", True, dict(windows_per_block=2, two_pass=True, dc=32)),
    # the XLA state epilogue instead of the fused state copy; one (partial) block of 8 windows; Hadamard as a dot
    (4, True, "bf16", True, dict(windows_per_block=8, two_pass=True, fuse_state=False, mix="dot")),
    # another small ratio, no overlap
    full(8, False, "fp4", True, dict(windows_per_block=2, slot_block=4)),
    # pass 2 with its own window blocks and channel chunks (larger / smaller than pass 1's)
    full(4, True, "fp4", True, dict(windows_per_block=2, two_pass=True, dc=32, finish_windows_per_block=8,
                                    finish_dc=64)),
    (4, True, "fp8", True, dict(windows_per_block=8, two_pass=True, dc=64, finish_windows_per_block=2,
                                finish_dc=32)),
])
@full_tier
def test_kernel_options_small_ratio(r, overlap, fmt, rotate, opts):
    """Kernel variants (block / slot / channel sizes, layouts): a partial last window block, chunks starting at every
    window offset, ragged n_valid, a tiny cap (windows with dest >= cap dropped)."""
    inp, kw = make(4, 13, r, overlap, 128, fmt, starts=[0, r + 1, 2 * r + 2, 3 * r + 3], n_valid=[13, 9, 2, 13],
                   cap=4)
    assert check(inp, kw, "pallas", TOL[fmt], rotate=rotate, **opts) > 0


@pytest.mark.parametrize("opts", [dict(windows_per_block=2, slot_block=32, two_pass=False),
                                  full(dict(windows_per_block=1, slot_block=16, two_pass=True, dc=32))])
@full_tier
def test_kernel_options_ratio128(opts):
    """ratio 128: slots walked in sub-blocks (online softmax), fused and two-pass layouts; cap 2 drops row 2's
    window (dest 2) while its state still advances."""
    inp, kw = make(3, 200, 128, False, 128, "bf16", starts=[0, 100, 383], n_valid=[200, 157, 3], cap=2)
    assert check(inp, kw, "pallas", TOL["bf16"], **opts) == 3


@pytest.mark.parametrize("r,overlap,d,fmt,opts", [
    full(4, True, 128, "fp4", dict(windows_per_block=8, slot_block=2, two_pass=False)),
    (4, True, 128, "fp8", dict(windows_per_block=4, two_pass=True, mix="dot", dc=32)),
    full(4, True, 512, None, dict(windows_per_block=16, two_pass=True, fuse_state=False)),
    (4, True, 128, "fp8", dict(windows_per_block=8, two_pass=True, dc=32, finish_windows_per_block=32)),
    (128, False, 512, None, dict(windows_per_block=2, slot_block=32, two_pass=False, num_stages=3)),
])
@full_tier
def test_kernel_options_lower_for_cuda(r, overlap, d, fmt, opts):
    """The Triton lowering (no GPU needed) accepts the variants: 3-D tile reshapes, split / join, transposes,
    fori_loops, conditional state copies."""
    from pallas_kernels.compressor.gpu import compress_chunk_gpu

    inp, kw = make(2, 40, r, overlap, d, fmt)
    keys = ("kv", "gate", "start", "n_valid", "state_kv", "state_gate", "prev_kv", "prev_gate", "entries")
    fn = lambda *a: compress_chunk_gpu(*a, **kw, rotate=fmt is not None, **opts)
    text = jax.jit(fn).trace(*(inp[k] for k in keys)).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_compressor_argument_errors(impl):
    """Malformed arguments raise a ValueError naming the argument on every impl, before any kernel runs: before
    session 37 a [1] start broadcast over the batch in the reference and a larger entries batch ran the kernel."""
    inp, kw = make(2, 9, 4, True, 128, None, starts=[0, 4], n_valid=[9, 9], cap=2)
    cases = [
        (dict(gate=inp["gate"][..., :64]), "gate must have shape \\(2, 9, 256\\)"),
        (dict(kv=inp["kv"][0]), "kv must be \\[batch, chunk, c \\* dim\\]"),
        (dict(start=inp["start"][:1]), "start must have shape \\(2,\\)"),
        (dict(n_valid=inp["n_valid"].astype(jnp.float32)), "n_valid must be an integer array"),
        (dict(state_kv=inp["state_kv"][:1]), "state_kv must have shape"),
        (dict(state_gate=inp["state_gate"][:, :2]), "state_gate must have shape \\(2, 4, 256\\)"),
        (dict(prev_kv=None), "needs prev_kv and prev_gate"),
        (dict(prev_gate=inp["prev_gate"][..., :64]), "prev_gate must have shape \\(2, 4, 128\\)"),
        (dict(entries=jnp.concatenate([inp["entries"]] * 2)), "leading \\[batch=2, capacity\\]"),
    ]
    for change, msg in cases:
        with pytest.raises(ValueError, match=msg):
            call(dict(inp, **change), kw, impl=impl)
    with pytest.raises(ValueError, match="norm_weight must have shape \\(128,\\)"):
        call(inp, dict(kw, norm_weight=kw["norm_weight"][:64]), impl=impl)
    with pytest.raises(ValueError, match="ratio must be an integer >= 1"):
        call(inp, dict(kw, ratio=0), impl=impl)


def test_custom_encode_runs_on_the_reference_only():
    """a custom `encode` without key_format: impl="auto" runs the reference (the one implementation that can call
    it), an explicit kernel impl raises instead of falling back in silence."""
    inp, kw = make(2, 9, 4, True, 128, None, starts=[0, 4], n_valid=[9, 9], cap=2)
    kw2 = dict(kw)
    kw2.pop("key_format")
    enc = lambda x: (x * 2.0).astype(jnp.float32)
    out = call(inp, kw2, impl="auto", encode=enc)
    ref = call(inp, kw2, impl="reference", encode=enc)
    np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(ref[0]))
    for impl in ("pallas", "interpret_tpu"):
        with pytest.raises(ValueError, match="custom `encode` callable runs only in the reference"):
            call(inp, kw2, impl=impl, encode=enc)


def test_decode_chain_matches_reference():
    """12 jitted decode steps (S = 1) through the kernel's state vs the reference's, fp4 rotated keys."""
    inp, kw = make(2, 1, 4, True, 128, "fp4", starts=[0, 2], n_valid=[1, 1], fresh=True, cap=8)

    def step(impl):
        def f(st, x):
            kv, gate = x
            ent, skv, sg, pkv, pg, start = st
            out = compress_chunk(kv, gate, start, inp["n_valid"], skv, sg, pkv, pg, ent, **kw, rotate=True, impl=impl)
            return (*out, start + 1), None
        return jax.jit(lambda st, xs: jax.lax.scan(f, st, xs)[0])

    rng = np.random.default_rng(next(_SEED))
    xs = (jnp.asarray(rng.standard_normal((12, 2, 1, 256)), jnp.float32),
          jnp.asarray(rng.standard_normal((12, 2, 1, 256)), jnp.float32))
    st0 = (inp["entries"], inp["state_kv"], inp["state_gate"], inp["prev_kv"], inp["prev_gate"], inp["start"])
    a = step("pallas")(st0, xs)
    b = step("reference")(st0, xs)
    ea, eb = np.asarray(F.dequantize(a[0])), np.asarray(F.dequantize(b[0]))
    assert np.linalg.norm(ea - eb) <= TOL["fp4"] * np.linalg.norm(eb)
    for x, y in zip(a[1:5], b[1:5]):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=0)


def test_dispatch(monkeypatch):
    assert resolve_impl("reference") == "reference"
    assert resolve_impl("auto") == ("gpu" if ON_GPU else "tpu" if jax.default_backend() == "tpu" else "reference")
    with pytest.raises(ValueError):
        resolve_impl("triton")
    # DSV4_KERNEL_PLATFORM (ahead-of-time compiles for another device, benchmarks/tpu_offline.py) overrides the
    # backend every dispatcher asks
    from pallas_kernels.indexer import resolve_impl as indexer_impl
    from pallas_kernels.sparse_attention import resolve_impl as attention_impl

    monkeypatch.setenv("DSV4_KERNEL_PLATFORM", "tpu")
    assert [f("auto") for f in (resolve_impl, indexer_impl, attention_impl)] == ["tpu"] * 3
    assert resolve_impl("reference") == "reference"
    monkeypatch.setenv("DSV4_KERNEL_PLATFORM", "cpu")
    assert resolve_impl("auto") == "reference" and resolve_impl("pallas") == "interpret"
    monkeypatch.setenv("DSV4_KERNEL_PLATFORM", "tpuv9")
    with pytest.raises(ValueError, match="DSV4_KERNEL_PLATFORM must be one of"):
        resolve_impl("auto")


# ---- compiled kernel on a real GPU ---------------------------------------------------------------------------

gpu = pytest.mark.skipif(not ON_GPU, reason="needs a GPU (compiled Triton Pallas kernel)")


@gpu
@pytest.mark.parametrize("fmt,rotate", [(None, False), ("bf16", True), ("fp8", True), ("fp4", True), ("fp4", False)])
def test_gpu_indexer_compressor(fmt, rotate):
    inp, kw = make(4, 300, 4, True, 128, fmt, starts=[0, 5, 10, 15], n_valid=[300, 0, 297, 123])
    assert check(inp, kw, "pallas", TOL[fmt], rotate=rotate) > 0
    inp, kw = make(8, 1, 4, True, 128, fmt, starts=[3, 0, 1, 2, 3, 7, 11, 6], n_valid=[1] * 7 + [0], fresh=True)
    check(inp, kw, "pallas", TOL[fmt], rotate=rotate)


@gpu
@pytest.mark.parametrize("r,overlap,S", [(4, True, 1), (4, True, 1000), (128, False, 1), (128, False, 1000)])
def test_gpu_main_compressor(r, overlap, S):
    starts = [0, 1, r - 1, 5 * r + 2]
    inp, kw = make(4, S, r, overlap, 512, None, ndt=jnp.bfloat16, starts=starts, n_valid=[S, S, S - S // 3, 1])
    check(inp, kw, "pallas", TOL["bf16"])


@gpu
@pytest.mark.parametrize("r,overlap,opts", [
    (4, True, dict(two_pass=False, windows_per_block=8)), (4, True, dict(two_pass=True, windows_per_block=32)),
    (4, True, dict(two_pass=False, windows_per_block=4, slot_block=2, fuse_state=False)),
    (128, False, dict(two_pass=True, slot_block=64, dc=32)), (128, False, dict(two_pass=False, slot_block=32)),
    (128, False, dict(two_pass=True, slot_block=128, num_warps=8, num_stages=1)),
    (4, True, dict(two_pass=True, windows_per_block=8, dc=32, finish_windows_per_block=32, finish_dc=64))])
def test_gpu_kernel_options(r, overlap, opts):
    """Compiled kernel variants: main compressor (bf16), and the indexer's rotated fp8 / fp4 keys at ratio 4."""
    starts = [0, 1, r - 1, 5 * r + 2]
    inp, kw = make(4, 1000, r, overlap, 512, None, ndt=jnp.bfloat16, starts=starts, n_valid=[1000, 999, 600, 1])
    check(inp, kw, "pallas", TOL["bf16"], **opts)
    if r == 4:
        for fmt in ("fp8", "fp4"):
            inp, kw = make(4, 300, 4, True, 128, fmt, starts=starts, n_valid=[300, 0, 297, 123], cap=60)
            assert check(inp, kw, "pallas", TOL[fmt], rotate=True, **opts) > 0


@pytest.mark.parametrize("ratio,overlap,S,impl", [
    (r, o, S, i) if (i, S) == ("pallas", 1) else full(r, o, S, i)
    for i in ("pallas", "interpret_tpu") for r, o, S in [(4, True, 9), (4, True, 1), (128, False, 130), (4, True, 70)]])
def test_main_kv_fp8_rows(ratio, overlap, S, impl):
    """The main compressor writing the 584-B FP8 KV rows (Fp8KVPool entries), interpreted GPU / TPU kernel vs
    reference: same rows written, the rest untouched, dequantized entries equal up to an e4m3 rounding step."""
    from pallas_kernels.sparse_attention.fp8_layout import Fp8KVPool, dequantize_kv_fp8, quantize_kv_fp8_rows

    inp, kw = make(2, S, ratio, overlap, 512, None, starts=[ratio - 1, 2 * ratio + 1], n_valid=[S, S - 1])
    inp["entries"] = quantize_kv_fp8_rows(inp["entries"])
    kw["key_format"] = "kv_fp8"
    out, ref = call(inp, kw, impl=impl), call(inp, kw, impl="reference")
    assert isinstance(out[0], Fp8KVPool) and out[0].nope.dtype == jnp.float8_e4m3fn
    deq = lambda p: np.asarray(dequantize_kv_fp8(jax.tree_util.tree_map(lambda a: a.reshape((-1,) + a.shape[2:]), p)))
    e, er, e0 = deq(out[0]), deq(ref[0]), deq(inp["entries"])
    written = np.any(er != e0, axis=-1)
    assert written.any()
    np.testing.assert_array_equal(np.any(e != e0, axis=-1), written)
    assert np.linalg.norm(e[written] - er[written]) / np.linalg.norm(er[written]) <= 3e-2
    np.testing.assert_array_equal(np.asarray(out[0].scale), np.asarray(ref[0].scale))
    for a, b_ in zip(out[1:], ref[1:]):
        if b_ is not None:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b_))
