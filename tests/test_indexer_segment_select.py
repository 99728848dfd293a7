"""The segment selection inside the Mosaic indexer scores kernel (`mosaic_select`, topk="segment_set").

CPU: the selection rule (`segment_select_model`) against `lax.top_k` sets on fresh random, concentrated, tied,
ragged and non-finite scores; survivors of a row's segments composed with the final selection (`hist_select` with
the position map, in the Triton interpreter) give the row's top-k set; the PTX assembles (ptxas, where found); every
mode lowers for CUDA; where "auto_set" takes it; the option errors. GPU (`test_gpu_*`, skipped elsewhere): the
kernel's survivors equal the model applied to the same kernel's own scores bit for bit, and topk="segment_set" picks
the same index set as the tournament over the same scores and as the reference, with the Triton final and with the
row's final selection inside the kernel (a thread-block cluster)."""

from __future__ import annotations

import glob
import itertools
import os
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.indexer import formats as F
from pallas_kernels.indexer import mosaic_select as M
from pallas_kernels.indexer import indexer_topk, indexer_topk_reference
from test_indexer_kernels import make
from tiers import core, sweep

_SEED = itertools.count(40000)


def make_on_device(B, T, fmt, seed, H=64, d=128, S=1, rows_per=128):
    """A decode call's (q, w, keys, nv) with the keys drawn on the device a few rows at a time and quantized there:
    `make` draws [B, T, d] float64 on the host, 43 GB at B = 1280 x 32768 and as much again for its `* 2.0` (session
    61: such a case failed on an H100 with its report cut off by the call's time limit; the host draw is the likely
    cause), and moves it to the device as one f32 array (10-12 GB at 640-768 x 32768: session 62's GPU runs with 3
    and 8 pytest workers ran out of memory there, results/h100_s62r{2,3}_tests5.log). Rotated (Hadamard) q and
    keys, ragged n_visible with 0 and > T."""
    key = jax.random.key(seed)
    kq, kw, kk, kn = jax.random.split(key, 4)
    q = F.hadamard(jax.random.normal(kq, (B, S, H, d), jnp.float32))
    q = F.fake_quantize(q, fmt) if fmt in ("fp8", "fp4") else q
    w = jax.random.normal(kw, (B, S, H), jnp.float32) * (H ** -0.5 * d ** -0.5)
    draw = jax.jit(lambda k_, n: F.quantize(F.hadamard(2.0 * jax.random.normal(k_, (n, T, d), jnp.float32)), fmt),
                   static_argnums=1)
    parts = [draw(jax.random.fold_in(kk, i), min(rows_per, B - i)) for i in range(0, B, rows_per)]
    keys = jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *parts)
    nv = jax.random.randint(kn, (B, S), 0, T + 3, jnp.int32).at[0, 0].set(0).at[-1, -1].set(T + 5)
    return q, w, keys, nv


def make_decode(B, S, H, T, fmt):
    """`make(B, S, H, T, fmt, rotate=True)`, or `make_on_device` from 256 rows on (f32 keys of 4 GiB and more at 32768
    candidates)."""
    if B >= 256:
        return make_on_device(B, T, fmt, next(_SEED), H=H, S=S)
    return make(B, S, H, T, fmt, True)


ON_GPU = jax.default_backend() == "gpu"
gpu = pytest.mark.skipif(not ON_GPU, reason="needs a GPU (compiled Mosaic GPU kernel)")


def topk_set(scores, k, pos0=0):
    """The exact top-k of valid entries (key above -inf's; ties -> lower position) as a set of positions."""
    key = M._ordered(scores)
    idx = np.nonzero(key > M.NEG_INF_KEY)[0]
    order = idx[np.lexsort((idx, -key[idx].astype(np.int64)))]
    return set((order[:k] + pos0).tolist())


def scores_of(kind, n, rng):
    if kind == "normal":
        s = rng.standard_normal(n).astype(np.float32)
    elif kind == "concentrated":      # one value +- a few ulps: the first digits say nothing, the last decide
        s = (np.float32(1000.0) + rng.integers(-40, 40, n).astype(np.float32) * np.float32(2.0 ** -14))
    elif kind == "ties":              # a handful of values, heavy ties at the k-th
        s = rng.integers(0, 5, n).astype(np.float32)
    elif kind == "relu":              # the indexer's scores: sums of ReLUs, many exact zeros
        s = np.maximum(rng.standard_normal(n), 0).astype(np.float32) * rng.integers(0, 2, n)
    elif kind == "wide":              # every magnitude and sign
        s = (rng.standard_normal(n) * 10.0 ** rng.integers(-30, 30, n)).astype(np.float32)
    else:
        raise ValueError(kind)
    return s.astype(np.float32)


@pytest.mark.parametrize("n,k,slack", sweep([core(8192, 512, 64), (8192, 512, 0), core(2048, 512, 64),
                                             (512, 512, 64), (128, 7, 0), (1024, 1, 3), (4096, 1024, 64)]))
@pytest.mark.parametrize("kind", ["normal", "concentrated", "ties", "relu", "wide"])
def test_segment_select_model_keeps_the_top_k(n, k, slack, kind):
    """The rule keeps a superset of the segment's top-k set in ascending position, at most k + slack entries, each a
    valid entry with its own key and position, (INT32_MIN, 0) padding after; also with -inf masks (a ragged tail,
    scattered holes), fewer valid entries than k, and +inf / NaN among them."""
    rng = np.random.default_rng(next(_SEED))
    slots = k + slack
    for trial in range(4):
        s = scores_of(kind, n, rng)
        if trial == 1:                                      # ragged tail: the cache filled to L < n
            s[rng.integers(0, n):] = -np.inf
        if trial == 2:                                      # holes, and fewer valid entries than k
            s[rng.random(n) < 0.97] = -np.inf
        if trial == 3:                                      # non-finite values among the valid ones
            s[rng.integers(0, n, 5)] = np.inf
            s[rng.integers(0, n, 3)] = np.nan
            s[rng.integers(0, n, 3)] = -np.nan
        pos0 = int(rng.integers(0, 1 << 20))
        keys, pos = M.segment_select_model(s, pos0, k, slots)
        used = keys != M.INT32_MIN
        m = int(used.sum())
        assert used[:m].all() and not used[m:].any() and (pos[m:] == 0).all()
        kept = pos[:m] - pos0
        assert np.all(np.diff(kept) > 0)                    # ascending position, no duplicates
        np.testing.assert_array_equal(keys[:m], M._ordered(s)[kept])
        assert np.all(keys[:m] > M.NEG_INF_KEY)
        assert topk_set(s, k) <= set(kept.tolist()), "an entry of the top-k set was dropped"


@pytest.mark.parametrize("R,T,seg", [core(2, 32768, 8192), (3, 20000, 4096)])
def test_segment_survivors_select_the_row_set(R, T, seg):
    """Survivors of every segment of a row (the model), side by side, through `gpu.select_from_survivors` (the final
    `hist_select` with the position map, in the Triton interpreter) give the row's top-k index set, -1 for
    non-finite picks: ties across segments go to the lower position."""
    from pallas_kernels.indexer.gpu import select_from_survivors
    from pallas_kernels.indexer.topk import as_index_set

    rng = np.random.default_rng(next(_SEED))
    k, slots = 512, 576
    s = np.stack([scores_of(kind, T, rng) for kind in ("ties", "normal", "relu")[:R]])
    s[0, T - 3000:] = -np.inf
    keys, pos = [], []
    for r in range(R):
        parts = [M.segment_select_model(s[r, a:a + seg], a, k, slots) for a in range(0, T, seg)]
        keys.append(np.concatenate([p[0] for p in parts]))
        pos.append(np.concatenate([p[1] for p in parts]))
    got = select_from_survivors(jnp.asarray(np.stack(keys)), jnp.asarray(np.stack(pos)), k, interpret=True)
    ref_vals, ref_idx = jax.lax.top_k(jnp.asarray(s), k)
    ref = as_index_set(jnp.where(jnp.isfinite(ref_vals), ref_idx, -1))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))


def _ptxas():
    found = os.environ.get("PTXAS") or shutil.which("ptxas")
    if not found:   # the nvidia-cuda-nvcc wheel's copy, where installed
        hits = glob.glob(os.path.join(os.path.dirname(np.__file__), "..", "nvidia", "cuda_nvcc", "bin", "ptxas"))
        found = hits[0] if hits else None
    return found


def _ptx_blocks():
    blocks = []
    for out, hist_ready, pos_in, aggregate in itertools.product(M.OUTS, (False, True), ("implicit", "smem"),
                                                                 (False, True)):
        for k, slack in ((512, 64), (1, 0), (7, 1), (1024, 64)):
            slots = k if out == "global_set" else k + slack
            if out == "global_set" and 2 * slots > M.BINS:
                continue
            name = f"sel_{out}_{int(hist_ready)}_{pos_in}_{int(aggregate)}_{k}_{slots}"
            blocks.append((name, M.segment_select_ptx(k, slots, aggregate=aggregate, hist_ready=hist_ready,
                                                      pos_in=pos_in, out=out), M._operand_kinds(out)))
    blocks += [(f"hist_block_{bt}_{int(agg)}", M.hist_block_ptx(bt, agg), "rrr") for bt in (64, 128, 192, 256)
               for agg in (False, True)]
    blocks += [("hist_zero", M.hist_zero_ptx(), "r")]
    blocks += [(f"gather_{n}_{slots}", M.gather_ptx(n, slots), "rrrr") for n, slots in ((4, 576), (8, 1088), (1, 4))]
    blocks += [(f"last_{n}_{slots}_{k}", M.last_final_ptx(n, slots, k), M.LAST_KINDS)
               for n, slots, k in ((4, 576, 512), (5, 1088, 1024), (1, 4, 1), (16, 128, 64))]
    blocks += [(f"prune_start_{k}_{cap}", M.prune_start_ptx(k, cap), "rrrr") for k, cap in ((512, 2048), (1, 64))]
    blocks += [(f"prune_append_{bt}", M.prune_append_ptx(bt, 2048), "rrrr") for bt in (64, 128, 192, 256)]
    blocks += [(f"prune_final_{out}", M.prune_final_ptx(512, 576, out=out), "rrrrllr" if out == "global_pairs"
                else "rrrrrrr") for out in ("global_pairs", "smem_pairs")]
    blocks += [("sel_probe2", M.segment_select_ptx(512, 576, hist_ready=True, compact=False), M._operand_kinds(
        "global_pairs"))]   # the timing probe: histogram levels and bin searches only
    # the split's selection and the last CTA's in one kernel (the "last" final's kernel holds both): the same labels
    # in two scopes of one function
    blocks += [("split_then_last", M.segment_select_ptx(512, 576, hist_ready=True) + "\n" + M.last_final_ptx(4, 576, 512),
                M.LAST_KINDS)]
    return blocks


def test_segment_select_ptx_assembles(tmp_path):
    """Every PTX block of the selection (each output mode, with / without the streamed histogram, positions
    implicit or in shared memory, aggregated atomics; the per-block histogram, its zeroing, the cluster gather),
    wrapped in kernels of their own, assembles for sm_90a without spills: no register, syntax or label error waits
    for the GPU. Skipped where no ptxas is found (PATH, $PTXAS, or the nvidia-cuda-nvcc wheel)."""
    ptxas = _ptxas()
    if not ptxas:
        pytest.skip("no ptxas (set PTXAS or pip install nvidia-cuda-nvcc-cu12)")
    src = tmp_path / "sel.ptx"
    src.write_text(M.standalone_ptx(_ptx_blocks()))
    res = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(src), "-o", str(tmp_path / "sel.cubin")],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stderr.count("0 bytes spill stores, 0 bytes spill loads") == len(_ptx_blocks())


def test_segment_select_errors():
    """Arguments the selection and the segment_set path refuse, with what to change."""
    from pallas_kernels.indexer.gpu import segment_topk
    from pallas_kernels.indexer.gpu_mosaic import indexer_scores_mosaic

    with pytest.raises(ValueError, match="1 <= k"):
        M.segment_select_ptx(10, 5)
    with pytest.raises(ValueError, match="multiple of 4"):
        M.last_final_ptx(4, 578, 512)
    with pytest.raises(ValueError, match="stages"):
        M.segment_select_ptx(1500, 1500, out="global_set")
    with pytest.raises(ValueError, match="out must be"):
        M.segment_select_ptx(5, 5, out="smem_set")
    q, w, keys, nv = make(2, 1, 64, 20000, "fp8", True)
    with pytest.raises(ValueError, match="compiled kernel"):
        indexer_scores_mosaic(q, w, keys, nv, select_k=512, precision="fp8", interpret=True)
    with pytest.raises(ValueError, match="group maxima"):
        indexer_scores_mosaic(q, w, keys, nv, select_k=512, group_max_k=512)
    with pytest.raises(ValueError, match="select_k must be in"):
        indexer_scores_mosaic(q, w, keys, nv, select_k=20001)
    with pytest.raises(ValueError, match="more than"):
        indexer_scores_mosaic(q, w, keys, nv, select_k=512, num_splits=1)
    with pytest.MonkeyPatch.context() as mp:
        from pallas_kernels.indexer import gpu_mosaic

        mp.setitem(gpu_mosaic.SELECT_CONFIG, "final", "cluster")   # 2 rows: ~66 splits a row, over a cluster's 8
        with pytest.raises(ValueError, match="needs <= 8 splits"):
            indexer_scores_mosaic(q, w, keys, nv, select_k=512)
        mp.setitem(gpu_mosaic.SELECT_CONFIG, "final", "somewhere")
        with pytest.raises(ValueError, match="must be one of"):
            indexer_scores_mosaic(q, w, keys, nv, select_k=512)
        mp.setitem(gpu_mosaic.SELECT_CONFIG, "final", "triton")
        mp.setitem(gpu_mosaic.SELECT_CONFIG, "probe", 3)
        with pytest.raises(ValueError, match="must be 0, 1 or 2"):
            indexer_scores_mosaic(q, w, keys, nv, select_k=512)
    with pytest.raises(ValueError, match="interpret mode"):
        segment_topk(q, w, keys, nv, k=512, interpret=True)
    with pytest.raises(ValueError, match="Mosaic scores kernel, got kernel"):
        segment_topk(q, w, keys, nv, k=512, kernel="triton")
    with pytest.raises(ValueError, match="do not apply"):
        segment_topk(q, w, keys, nv, k=512, num_warps=8)
    with pytest.raises(ValueError, match="head_dim 128"):
        segment_topk(*make(2, 1, 16, 300, "fp8", d=64), k=64)


@pytest.mark.parametrize("final,stream_hist", [("auto", True), ("triton", True), ("auto", False)])
def test_segment_set_lowers(final, stream_hist, monkeypatch):
    """The scores kernel with the selection, and the whole segment_set top-k, lower for CUDA from this machine: with
    the row's set selected in the kernel (33 rows x 8 splits: one cluster a row) or by the Triton final (2 rows,
    ~40 splits a row), the first histogram level counted during the stream or after it."""
    from test_gpu_lowering import lowers_for

    from pallas_kernels.indexer import gpu_mosaic
    from pallas_kernels.indexer.gpu import indexer_topk_gpu

    monkeypatch.setitem(gpu_mosaic.SELECT_CONFIG, "final", final)
    monkeypatch.setitem(gpu_mosaic.SELECT_CONFIG, "stream_hist", stream_hist)
    for fmt, B, T in (("fp8", 33, 4096), ("bf16", 2, 20000), ("fp4", 33, 4096)):
        q, w, keys, nv = make(B, 1, 64, T, fmt, True)
        text = lowers_for("cuda", "mosaic_gpu", lambda *a: indexer_topk_gpu(*a, k=512, topk="segment_set"),
                          q, w, keys, nv)
        assert "dsv4sel_compact" in text
        in_kernel = final == "auto" and B == 33
        assert ("dsv4gather" in text) == in_kernel and ("topk_hist" in text) != in_kernel   # the Triton final


def _abstract_inputs(B, T, fmt):
    """ShapeDtypeStructs of a decode call (one query a row, 64 heads): lowering needs no data."""
    sds = jax.ShapeDtypeStruct
    keys = {"fp8": F.QuantizedKeys(sds((B, T, 128), jnp.float8_e4m3fn), sds((B, T, 1), jnp.float32), "fp8"),
            "fp4": F.QuantizedKeys(sds((B, T, 64), jnp.uint8), sds((B, T, 4), jnp.uint8), "fp4"),
            "bf16": sds((B, T, 128), jnp.bfloat16)}[fmt]
    return sds((B, 1, 64, 128), jnp.float32), sds((B, 1, 64), jnp.float32), keys, sds((B, 1), jnp.int32)


# `test_gpu_segment_set_last_final`'s cases (B, T, fmt, k, opts), each where final "last" runs; the CPU test below
# lowers them too, so a default split count that moves one off "last" fails in CI, not first on a GPU. B = 64 x
# 40000 keys: 5 splits given (by default 320 CTAs pass a wave, and `select_splits` takes 8 of ~5K keys, whose
# survivors do not fit).
LAST_FINAL_CASES = [(64, 32768, "fp8", 512, {}), (64, 40000, "fp8", 512, dict(num_splits=5)),
                    (8, 32768, "fp8", 512, dict(num_splits=5)), (6, 32768, "fp4", 512, dict(num_splits=4)),
                    (4, 4096, "fp8", 64, dict(num_splits=4)), (5, 4096, "bf16", 64, dict(num_splits=3)),
                    (3, 20000, "fp8", 4, dict(num_splits=7))]


@pytest.mark.parametrize("fmt,B,T,k,opts,takes", [(f, B, T, k, o, True) for B, T, f, k, o in LAST_FINAL_CASES] +
                         [("fp8", 64, 40000, 512, {}, False), ("fp8", 64, 32768, 512, dict(num_splits=6), False),
                          ("fp8", 16, 32768, 512, {}, False), ("bf16", 8, 16384, 512, {}, False),
                          ("fp8", 64, 32768, 512, dict(probe=2), True)])
def test_segment_set_last_final_lowers(fmt, B, T, k, opts, takes, monkeypatch):
    """final "last": the split CTA that arrives last selects the row's set in the kernel (no Triton kernel follows)
    where the row's survivors fit its segment buffer: 4 or 5 splits of ~8K keys at B = 64 (128K-160K context); many
    short splits (B = 16, 6 splits given, or 64 x 40000 at its default 8) keep the Triton final. Lowers for CUDA
    from this machine."""
    from test_gpu_lowering import lowers_for

    from pallas_kernels.indexer import gpu_mosaic
    from pallas_kernels.indexer.gpu import indexer_topk_gpu

    monkeypatch.setitem(gpu_mosaic.SELECT_CONFIG, "final", "last")
    opts = dict(opts)
    probe = opts.pop("probe", 0)   # 2: the timing probe (no compaction, no final)
    monkeypatch.setitem(gpu_mosaic.SELECT_CONFIG, "probe", probe)
    text = lowers_for("cuda", "mosaic_gpu", lambda *a: indexer_topk_gpu(*a, k=k, topk="segment_set", **opts),
                      *_abstract_inputs(B, T, fmt))
    assert "dsv4sel_compact" in text
    assert "dsv4sel_ca:" in text or probe
    assert ("dsv4last_load" in text) == (takes and not probe) and ("topk_hist" in text) != takes


def test_auto_set_takes_segment_set(monkeypatch):
    """"auto_set" runs "segment_set" where it resolved to the tournament and the scores run on the Mosaic kernel over
    fp8 / fp4 keys with rows of 8193-262144 candidates (past 32K up to 1M context: where it measured faster, sessions
    40, 57-59), for calls of up to 2048 rows (1024 before session 62); bf16 keys, shorter rows, the Triton kernel
    and interpret mode keep their method."""
    from pallas_kernels.indexer import gpu

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")   # the Mosaic kernel's auto rule asks for a GPU
    sds = jax.ShapeDtypeStruct
    q = lambda B, S=1: sds((B, S, 64, 128), jnp.float32)
    fp8 = lambda B, T: F.QuantizedKeys(sds((B, T, 128), jnp.float8_e4m3fn), sds((B, T, 1), jnp.float32), "fp8")
    bf16 = lambda B, T: sds((B, T, 128), jnp.bfloat16)
    assert gpu.segment_auto_takes(q(64), fp8(64, 32768), False, {})
    assert gpu.segment_auto_takes(q(16), fp8(16, 20000), False, {})
    assert not gpu.segment_auto_takes(q(64), fp8(64, 32768), True, {})              # interpret mode
    assert not gpu.segment_auto_takes(q(64), bf16(64, 32768), False, {})            # bf16 keys: slower
    assert gpu.segment_auto_takes(q(64), fp8(64, 16384), False, {})                 # 64K context (session 58)
    assert gpu.segment_auto_takes(q(64), fp8(64, 12288), False, {})                 # 48K context (session 59)
    assert gpu.segment_auto_takes(q(64), fp8(64, 8200), False, {})
    assert not gpu.segment_auto_takes(q(64), fp8(64, 8192), False, {})              # 32K: no faster, hist_set
    assert gpu.segment_auto_takes(q(16), fp8(16, 65536), False, {})                 # 256K context (session 58)
    assert gpu.segment_auto_takes(q(64), fp8(64, 262144), False, {})                # 1M
    assert not gpu.segment_auto_takes(q(64), fp8(64, 262152), False, {})            # past 1M: not timed
    assert not gpu.segment_auto_takes(q(8), fp8(8, 32768), False, {})               # the Triton scores kernel
    assert not gpu.segment_auto_takes(q(64), fp8(64, 32768), False, {"kernel": "triton"})
    # since session 57 also where the rule gave the chain (65-95 rows) or the histogram kernel (96-128 rows)
    method = lambda B, keys: gpu.auto_set_method(q(B), keys, 512, False, {})
    fp4 = lambda B, T: F.QuantizedKeys(sds((B, T, 64), jnp.uint8), sds((B, T, 4), jnp.uint8), "fp4")
    for B in (16, 64, 80, 100, 128, 192, 256, 384, 512, 640, 1024,   # past 512 rows since session 59
              1025, 1280, 2048):                                     # past 1024 since session 62
        assert method(B, fp8(B, 32768)) == method(B, fp4(B, 32768)) == "segment_set", B
    for B, T in ((64, 16384), (16, 65536), (64, 65536), (16, 262144), (64, 262144),   # 64K-1M (session 58)
                 (64, 10240), (128, 12288), (64, 15360)):                             # 40K-60K (session 59)
        assert method(B, fp8(B, T)) == method(B, fp4(B, T)) == "segment_set", (B, T)
    assert gpu.resolve_set_method(32768, 512, 80) == "threshold_set"   # what those rows took before
    assert gpu.resolve_set_method(32768, 512, 100) == "hist_set"
    assert gpu.resolve_set_method(262144, 512, 64) == "threshold_set"
    assert method(2049, fp8(2049, 32768)) == "hist_set"                # past AUTO_SEGMENT_ROWS: not timed
    # prefill chunks (256 queries a row) score on the Triton kernel: their method, whatever the rows
    assert gpu.auto_set_method(q(8, 256), fp8(8, 32768), 512, False, {}) == gpu.resolve_set_method(32768, 512, 2048)
    assert method(64, fp8(64, 12288)) != gpu.resolve_set_method(12288, 512, 64) == "hist_set"   # what 48K took
    assert method(8, fp8(8, 262144)) == gpu.resolve_set_method(262144, 512, 8)   # B < MIN_ROWS: Triton scores
    assert method(80, fp8(80, 8192)) == "hist_set"                     # shorter rows keep their method
    assert method(80, bf16(80, 32768)) == gpu.resolve_set_method(32768, 512, 80)
    seen = []

    def spy(*a, **kw):
        seen.append(kw.get("topk", "segment"))
        return jnp.zeros((64, 1, 512), jnp.int32)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gpu, "segment_topk", spy)
        jax.eval_shape(lambda *a: gpu.indexer_topk_gpu(*a, k=512, topk="auto_set"), q(64),
                       sds((64, 1, 64), jnp.float32), fp8(64, 32768), sds((64, 1), jnp.int32))
    assert seen == ["segment"]


def test_segment_splits_past_one_wave():
    """The segment top-k's default split count: the fewest splits whose segments fit (T / max_segment) up to one wave
    of CTAs (TARGET_CTAS), past it `select_splits`' (the counts measured fastest on the H100, session 57: 6 at
    B = 80, 5 at 100, 4 at 128); an explicit num_splits is kept."""
    from pallas_kernels.indexer.gpu_mosaic import launch_layout

    splits = lambda R, fmt="fp4", **kw: launch_layout(R, 32768, fmt, select=True, converter=2 if fmt == "fp4" else 0,
                                                     **kw)[4]
    assert [splits(R) for R in (1, 16, 64, 80, 100, 128)] == [64, 16, 4, 6, 5, 4]
    assert [splits(R, "fp8") for R in (64, 80, 100, 128)] == [4, 6, 5, 4]
    assert splits(80, num_splits=4) == 4
    assert launch_layout(80, 32768, "fp8")[4] == 3   # the scores alone (no segments): one wave, as before


def _split_layout(R, T, fmt, **opts):
    """(n_split, keys a split) of the select-mode kernel's call of R query rows at T."""
    from pallas_kernels.indexer.gpu_mosaic import launch_layout

    bt, _, _, bps, n_split = launch_layout(R, T, fmt, select=True, **opts)
    return n_split, bps * bt


@gpu
@pytest.mark.parametrize("B,S,H,T,fmt,opts", [(4, 1, 64, 20000, "fp8", {}), (2, 2, 64, 70000, "fp8", {}),
                                               (3, 1, 16, 776, "fp8", {}), (8, 1, 64, 32768, "fp8", dict(num_splits=4)),
                                               (2, 1, 64, 9000, "fp8", dict(block_t=64, num_splits=5)),
                                               (3, 1, 64, 20000, "bf16", {}), (3, 1, 64, 20000, "fp4", {})])
@pytest.mark.parametrize("stream_hist", [True, False])
def test_gpu_segment_survivors_match_the_model(B, S, H, T, fmt, opts, stream_hist, monkeypatch):
    """The kernel's survivors (keys and positions, every split; the Triton final's input) equal
    `segment_select_model` applied to the same kernel's own scores of that split, bit for bit: the PTX does what
    the model does. Ragged n_visible (0, inside, past T); the first histogram level during the stream or after."""
    from pallas_kernels.indexer import gpu_mosaic

    monkeypatch.setitem(gpu_mosaic.SELECT_CONFIG, "final", "triton")
    monkeypatch.setitem(gpu_mosaic.SELECT_CONFIG, "stream_hist", stream_hist)
    _check_survivors(*make(B, S, H, T, fmt, True), T, fmt, **opts)


def _check_survivors(q, w, keys, nv, T, fmt, **opts):
    """The select-mode kernel's survivors (every row and split) equal `segment_select_model` over the same kernel's
    own scores of that split, bit for bit."""
    from pallas_kernels.indexer.gpu_mosaic import indexer_scores_mosaic

    R = q.shape[0] * q.shape[1]
    n_split, seg = _split_layout(R, T, fmt, **opts)
    sk, sp = jax.jit(lambda *a: indexer_scores_mosaic(*a, select_k=512, **opts))(q, w, keys, nv)
    scores = np.asarray(jax.jit(lambda *a: indexer_scores_mosaic(*a, pad_to_block=True, **opts))(q, w, keys, nv))
    sk, sp = np.asarray(sk).reshape(R, n_split, -1), np.asarray(sp).reshape(R, n_split, -1)
    for r in range(R):
        for j in range(n_split):
            part = scores.reshape(R, -1)[r, j * seg:(j + 1) * seg]
            mk, mp = M.segment_select_model(part, j * seg, 512, sk.shape[-1])
            np.testing.assert_array_equal(sk[r, j], mk, err_msg=f"keys of row {r}, split {j}")
            np.testing.assert_array_equal(sp[r, j], mp, err_msg=f"positions of row {r}, split {j}")


@gpu
@pytest.mark.parametrize("B,T,opts", [(3, 20000, {}), (8, 32768, dict(num_splits=4)), (5, 4000, {})])
@pytest.mark.parametrize("mosaic", [dict(seg_hist="converter"), dict(seg_hist="converter", conv_sync="early"),
                                    dict(seg_hist="converter", conv_sync="early", select_wgs=2),
                                    dict(seg_hist="converter", select_wgs=2)],
                         ids=["hist", "hist_early", "hist_early_s2", "hist_s2"])
def test_gpu_fp4_segment_survivors_converter_options(B, T, opts, mosaic, monkeypatch):
    """The fp4 converter kernel's options of sessions 75-76 (seg_hist "converter": the converter counts the
    streamed histogram; conv_sync "early"; select_wgs 2: both warpgroups select) keep the survivors bit for bit
    `segment_select_model`'s over the kernel's own scores, every split, ragged n_visible."""
    from pallas_kernels.indexer import gpu_mosaic

    monkeypatch.setitem(gpu_mosaic.SELECT_CONFIG, "final", "triton")
    for name, value in mosaic.items():
        monkeypatch.setitem(gpu_mosaic.MOSAIC_CONFIG, name, value)
    _check_survivors(*make(B, 1, 64, T, "fp4", True), T, "fp4", **opts)


def _tournament_sets(q, w, keys, nv, k):
    """What segment_set's index set must equal: (the tournament's set over the same Mosaic scores, the sorted picks'
    set, the sorted picks)."""
    from pallas_kernels.indexer.topk import as_index_set

    tour = np.asarray(indexer_topk(q, w, keys, nv, k=k, impl="pallas", picks="set", topk="tour_set", kernel="mosaic"))
    sorted_picks = indexer_topk(q, w, keys, nv, k=k, impl="pallas", kernel="mosaic")
    return tour, np.asarray(as_index_set(sorted_picks)), sorted_picks


@gpu
@pytest.mark.parametrize("B,S,H,T,fmt", [(4, 1, 64, 20000, "fp8"), (64, 1, 64, 32768, "fp8"),
                                         (2, 2, 64, 70000, "fp8"), (5, 1, 16, 776, "fp8"), (3, 1, 64, 20000, "bf16"),
                                         (3, 1, 64, 20000, "fp4"), (20, 2, 64, 20000, "fp8"),
                                         (33, 1, 64, 4096, "bf16"), (64, 1, 64, 32768, "fp4"),
                                         (16, 1, 64, 32768, "fp8"), (3, 1, 64, 262144, "fp4"),
                                         (2, 1, 64, 262144, "fp8"), (64, 1, 64, 12288, "fp4"),
                                         (24, 1, 64, 10240, "fp8"), (640, 1, 64, 32768, "fp8")])
@pytest.mark.parametrize("final", ["auto", "triton", "last"])   # "auto": the cluster final where it applies
def test_gpu_segment_set_picks(B, S, H, T, fmt, final, monkeypatch):
    """topk="segment_set" picks the same index set as the tournament over the same Mosaic scores (exactly), and the
    reference's picks (up to near-ties, `check_picks`): the row's set selected in the kernel (final "auto" where a
    row's splits fit one cluster: 64 x 32768, 40 rows x 6 splits, 33 x 8; final "last" where the row's survivors fit
    the last split's segment buffer: 64 x 32768) or by the Triton final. 262144 keys (1M context): 32 splits a row,
    whose survivors go through tournament stages before the final. 10240 / 12288 keys (40K / 48K context) and 640
    rows: shapes session 59 timed it at before `auto_set` took it there."""
    from test_indexer_kernels import check_picks

    from pallas_kernels.indexer import gpu_mosaic

    monkeypatch.setitem(gpu_mosaic.SELECT_CONFIG, "final", final)
    q, w, keys, nv = make_decode(B, S, H, T, fmt)
    got = np.asarray(indexer_topk(q, w, keys, nv, k=512, impl="pallas", picks="set", topk="segment_set"))
    tour, sorted_set, sorted_picks = _tournament_sets(q, w, keys, nv, 512)
    np.testing.assert_array_equal(got, tour)
    np.testing.assert_array_equal(got, sorted_set)
    check_picks(sorted_picks, q, w, keys, nv, 512)


@gpu
@pytest.mark.parametrize("B,T,fmt", [(80, 32768, "fp8"), (100, 32768, "fp4"), (128, 32768, "fp8"),
                                     (192, 32768, "fp4"), (16, 65536, "fp8"), (20, 262144, "fp4"),
                                     (64, 16384, "fp4"), (384, 32768, "fp8"), (64, 12288, "fp8"),
                                     (768, 32768, "fp4")])
def test_gpu_auto_set_segment_past_one_wave(B, T, fmt):
    """The model's default picks (topk="auto_set") where "segment_set" took over from the chain / histogram top-k:
    at 128K context from 65 to 512 rows, with `select_splits`' split count (6 / 5 / 4 at 80 / 100 / 128 rows,
    session 57), at 64K, 256K and 1M context (session 58), at 48K context and past 512 rows (session 59). It gives
    the tournament's set over the same scores and the reference's picks up to near-ties."""
    from test_indexer_kernels import check_picks

    from pallas_kernels.indexer import gpu

    q, w, keys, nv = make_decode(B, 1, 64, T, fmt)
    assert gpu.auto_set_method(q, keys, 512, False, {}) == "segment_set"
    got = np.asarray(indexer_topk(q, w, keys, nv, k=512, impl="pallas", picks="set"))
    tour, sorted_set, sorted_picks = _tournament_sets(q, w, keys, nv, 512)
    np.testing.assert_array_equal(got, tour)
    np.testing.assert_array_equal(got, sorted_set)
    check_picks(sorted_picks, q, w, keys, nv, 512)


@gpu
@pytest.mark.parametrize("B,T,fmt", [(1280, 32768, "fp8"), (2048, 16384, "fp4")])
def test_gpu_segment_set_past_1024_rows(B, T, fmt):
    """The default picks (topk="auto_set", which takes "segment_set" up to AUTO_SEGMENT_ROWS = 2048 rows since
    session 62; H100, session 61: 12% faster than the default then at 1280 x 128K fp8, 3% at 2048 x 64K fp4,
    results/h100_s61r2_idx.log) on calls of more than 1024 rows, keys over 4 GiB at 1280 x 32768 fp8: the
    tournament's set over the same Mosaic scores and the reference's picks up to near-ties, on every row (session 62
    checked the reference's on the first and last 32 rows). Passed with topk="segment_set" on an H100 before the cap
    was raised (results/h100_s62r1_tests5.log), and on the default picks in session 63
    (results/h100_s63r2_tests5_past1024.log)."""
    from test_indexer_kernels import check_picks

    from pallas_kernels.indexer import gpu

    q, w, keys, nv = make_on_device(B, T, fmt, next(_SEED))
    assert gpu.auto_set_method(q, keys, 512, False, {}) == "segment_set"
    got = np.asarray(indexer_topk(q, w, keys, nv, k=512, impl="pallas", picks="set"))
    tour, sorted_set, sorted_picks = _tournament_sets(q, w, keys, nv, 512)
    np.testing.assert_array_equal(got, tour)
    np.testing.assert_array_equal(got, sorted_set)
    check_picks(sorted_picks, q, w, keys, nv, 512)   # every row, the reference 128 rows at a time


@gpu
@pytest.mark.parametrize("final", ["auto", "triton", "last"])
def test_gpu_segment_set_ties(final, monkeypatch):
    """Keys repeated along the cache: many exactly equal scores across splits; the lower positions win, as in the
    tournament and lax.top_k."""
    from pallas_kernels.indexer import gpu_mosaic

    monkeypatch.setitem(gpu_mosaic.SELECT_CONFIG, "final", final)
    rng = np.random.default_rng(next(_SEED))
    B, H, T = 64, 64, 32768
    base = rng.standard_normal((B, 64, 128)).astype(np.float32)
    keys = F.quantize(F.hadamard(jnp.asarray(np.tile(base, (1, T // 64, 1)))), "fp8")
    q = F.fake_quantize(F.hadamard(jnp.asarray(rng.standard_normal((B, 1, H, 128)), jnp.float32)), "fp8")
    w = jnp.asarray(rng.standard_normal((B, 1, H)), jnp.float32) * 0.01
    nv = jnp.asarray(np.tile([[T], [T - 1000], [5000], [100]], (B // 4, 1)), jnp.int32)
    got = indexer_topk(q, w, keys, nv, k=512, impl="pallas", picks="set", topk="segment_set")
    tour = indexer_topk(q, w, keys, nv, k=512, impl="pallas", picks="set", topk="tour_set", kernel="mosaic")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(tour))
    ref = indexer_topk_reference(q, w, keys, nv, k=512)
    np.testing.assert_array_equal((np.asarray(got) < 0).sum(-1), (np.asarray(ref) < 0).sum(-1))


@gpu
@pytest.mark.parametrize("B,T,fmt,k,opts", LAST_FINAL_CASES)
def test_gpu_segment_set_last_final(B, T, fmt, k, opts, monkeypatch):
    """final "last" (the split CTA that arrives last selects the row's set in the kernel), checked where it runs
    (the lowered module holds its PTX): 4-7 splits a row, k 512 / 64 / 4, fp8 / fp4 / bf16 keys, ragged n_visible.
    The set equals the tournament's over the same Mosaic scores and the sorted picks' set; the picks match the
    reference up to near-ties. Repeated three times: the arrival order of a row's CTAs changes between calls."""
    from test_indexer_kernels import check_picks

    from pallas_kernels.indexer import gpu_mosaic

    monkeypatch.setitem(gpu_mosaic.SELECT_CONFIG, "final", "last")
    q, w, keys, nv = make(B, 1, 64, T, fmt, True)
    fn = jax.jit(lambda *a: indexer_topk(*a, k=k, impl="pallas", picks="set", topk="segment_set", **opts))
    assert "dsv4last_load" in fn.lower(q, w, keys, nv).as_text().lower()
    tour, sorted_set, sorted_picks = _tournament_sets(q, w, keys, nv, k)
    for _ in range(3):
        got = np.asarray(fn(q, w, keys, nv))
        np.testing.assert_array_equal(got, tour)
        np.testing.assert_array_equal(got, sorted_set)
    check_picks(sorted_picks, q, w, keys, nv, k)


@pytest.mark.parametrize("final,fmt,B,T", [("triton", "fp8", 64, 32768), ("last", "fp8", 64, 32768),
                                           ("auto", "fp8", 33, 4096), ("triton", "fp4", 16, 32768),
                                           ("triton", "bf16", 8, 16384)])
def test_segment_set_pruned_lowers(final, fmt, B, T, monkeypatch):
    """SELECT_CONFIG prune: the threshold after the split's first half, the candidates appended block by block and
    the selection over the list lower for CUDA from this machine, with each final (the cluster's input in shared
    memory); the key ring then has prune_stages slots. Its errors: a capacity below k or not a multiple of 4, and
    the streamed histogram off."""
    from test_gpu_lowering import lowers_for

    from pallas_kernels.indexer import gpu_mosaic
    from pallas_kernels.indexer.gpu import indexer_topk_gpu

    monkeypatch.setitem(gpu_mosaic.SELECT_CONFIG, "final", final)
    monkeypatch.setitem(gpu_mosaic.SELECT_CONFIG, "prune", 2048)
    assert gpu_mosaic.launch_layout(64, 32768, "fp8", select=True)[1] == 2
    text = lowers_for("cuda", "mosaic_gpu", lambda *a: indexer_topk_gpu(*a, k=512, topk="segment_set"),
                      *_abstract_inputs(B, T, fmt))
    assert all(label in text for label in ("dsv4prs_chunk", "dsv4pra_end", "dsv4prf_whole", "dsv4selc_compact"))
    assert ("dsv4last_load" in text) == (final == "last")
    q, w, keys, nv = _abstract_inputs(64, 32768, "fp8")
    for cfg, match in ((dict(prune=510), "multiple of 4"), (dict(prune=256), ">= k"),
                       (dict(stream_hist=False), "stream_hist")):
        with pytest.MonkeyPatch.context() as mp:
            for name, value in cfg.items():
                mp.setitem(gpu_mosaic.SELECT_CONFIG, name, value)
            with pytest.raises(ValueError, match=match):
                jax.eval_shape(lambda *a: indexer_topk_gpu(*a, k=512, topk="segment_set"), q, w, keys, nv)


@gpu
@pytest.mark.parametrize("B,S,H,T,fmt,opts", [(4, 1, 64, 20000, "fp8", {}), (64, 1, 64, 32768, "fp8", {}),
                                               (8, 1, 64, 32768, "fp8", dict(num_splits=4)),
                                               (2, 1, 64, 9000, "fp8", dict(block_t=64, num_splits=5)),
                                               (3, 1, 64, 20000, "bf16", {}), (3, 1, 64, 20000, "fp4", {})])
@pytest.mark.parametrize("cap", [2048, 516])   # 516: the list overflows in many splits (the whole-split fallback)
def test_gpu_pruned_survivors_match_the_model(B, S, H, T, fmt, opts, cap, monkeypatch):
    """SELECT_CONFIG prune: the kernel's survivors equal `segment_select_pruned_model` of the same kernel's scores,
    bit for bit, every split: the candidates' threshold from the split's first half, the list, its overflow, and
    splits whose visible blocks end before the threshold's block (ragged n_visible: the whole-split model)."""
    from pallas_kernels.indexer import gpu_mosaic
    from pallas_kernels.indexer.gpu_mosaic import indexer_scores_mosaic, launch_layout

    monkeypatch.setitem(gpu_mosaic.SELECT_CONFIG, "final", "triton")
    monkeypatch.setitem(gpu_mosaic.SELECT_CONFIG, "prune", cap)
    q, w, keys, nv = make(B, S, H, T, fmt, True)
    bt, _, _, bps, n_split = launch_layout(B * S, T, fmt, select=True, **opts)
    seg = bps * bt
    sk, sp = jax.jit(lambda *a: indexer_scores_mosaic(*a, select_k=512, **opts))(q, w, keys, nv)
    scores = np.asarray(jax.jit(lambda *a: indexer_scores_mosaic(*a, pad_to_block=True, **opts))(q, w, keys, nv))
    sk, sp = np.asarray(sk).reshape(B * S, n_split, -1), np.asarray(sp).reshape(B * S, n_split, -1)
    slots, J = sk.shape[-1], bps // 2 - 1
    nvis = np.clip(np.asarray(nv).reshape(-1), 0, T)
    engaged = 0
    for r in range(B * S):
        for j in range(n_split):
            part = scores.reshape(B * S, -1)[r, j * seg:(j + 1) * seg]
            n_read = int(np.clip(-(-nvis[r] // bt) - j * bps, 0, bps))
            if bps >= 2 and n_read > J:
                engaged += 1
                mk, mp = M.segment_select_pruned_model(part, j * seg, 512, slots, (J + 1) * bt, cap)
            else:
                mk, mp = M.segment_select_model(part, j * seg, 512, slots)
            np.testing.assert_array_equal(sk[r, j], mk, err_msg=f"keys of row {r}, split {j}")
            np.testing.assert_array_equal(sp[r, j], mp, err_msg=f"positions of row {r}, split {j}")
    assert engaged


@gpu
@pytest.mark.parametrize("B,T,fmt,final", [(64, 32768, "fp8", "triton"), (64, 32768, "fp8", "last"),
                                           (64, 32768, "fp8", "auto"), (16, 32768, "fp8", "triton"),
                                           (64, 32768, "fp4", "last"), (3, 20000, "bf16", "triton"),
                                           (33, 4096, "fp8", "auto")])
def test_gpu_pruned_segment_set_picks(B, T, fmt, final, monkeypatch):
    """With pruning, segment_set's index set equals the tournament's over the same Mosaic scores and the sorted
    picks' set, with each final (the cluster where "auto" applies: 33 x 4096, 64 x 32768)."""
    from pallas_kernels.indexer import gpu_mosaic

    monkeypatch.setitem(gpu_mosaic.SELECT_CONFIG, "final", final)
    monkeypatch.setitem(gpu_mosaic.SELECT_CONFIG, "prune", 2048)
    q, w, keys, nv = make(B, 1, 64, T, fmt, True)
    got = np.asarray(indexer_topk(q, w, keys, nv, k=512, impl="pallas", picks="set", topk="segment_set"))
    tour, sorted_set, _ = _tournament_sets(q, w, keys, nv, 512)
    np.testing.assert_array_equal(got, tour)
    np.testing.assert_array_equal(got, sorted_set)
