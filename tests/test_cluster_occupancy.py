"""The ctypes mirror of CUDA's launch-config structs (cluster_occupancy.py) keeps the driver ABI's layout, and the
query degrades to None where no CUDA driver answers (the caller then takes the XLA merge). The query itself runs
on the GPU: test_sparse_attention_gpu.py::test_gpu_cluster_occupancy_query."""

import ctypes

import jax.numpy as jnp

from pallas_kernels.sparse_attention import cluster_occupancy as co


def test_launch_structs_match_the_driver_abi():
    # CUlaunchAttribute: 4 B id, 4 B pad, 64 B value union; CUlaunchConfig: 7 x u32, (pad), stream, attrs, numAttrs
    assert ctypes.sizeof(co._AttrValue) == 64
    assert ctypes.sizeof(co._Attr) == 72 and co._Attr.value.offset == 8
    assert co._LaunchConfig.hStream.offset == 32 and co._LaunchConfig.attrs.offset == 40
    assert co._LaunchConfig.numAttrs.offset == 48 and ctypes.sizeof(co._LaunchConfig) == 56


def test_no_driver_no_answer(monkeypatch):
    """Where libcuda cannot be loaded (CPU hosts), the query answers None rather than raising."""
    def no_driver(name, *a, **k):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(co.ctypes, "CDLL", no_driver)
    co.max_active_clusters.cache_clear()
    try:
        assert co.max_active_clusters(2, 200 * 1024) is None
    finally:
        co.max_active_clusters.cache_clear()


def test_fewer_splits_where_the_default_clusters_do_not_fit(monkeypatch):
    """combine="auto" at the default split count: where a row's clusters do not all fit at once, the largest smaller
    split count whose clusters do, if a CTA then gathers at most 64 entries more (the caps: the H100's, session 56)."""
    from pallas_kernels.sparse_attention import gpu_mosaic

    caps = {2: 66, 3: 39, 4: 30, 5: 22, 6: 17, 7: 15, 8: 15}
    monkeypatch.setattr(co, "max_active_clusters", lambda n, smem, threads=384, device=0: caps.get(n))
    fewer = lambda rows, ns, blocks, dtype=jnp.bfloat16: gpu_mosaic._fewer_splits_that_fit(
        rows, ns, blocks, 230 * 1024, dtype)
    assert fewer(32, 4, 10) == 3            # CSA B=32: 4 splits of <= 3 steps -> 3 of <= 4, in clusters
    assert fewer(40, 4, 10) is None         # 40 clusters of 3 do not fit either, and 2 splits take 5 steps
    assert fewer(16, 8, 130) is None        # HCA-8K B=16: 7 or 6 splits would take 19 or 22 steps instead of 17
    assert fewer(16, 8, 18) == 6            # 18 blocks: 8 splits of 3 steps -> 6 of 3
    assert fewer(32, 4, 10, jnp.float32) is None   # the cluster merge writes bf16 only
    fp8 = lambda rows, ns, blocks: gpu_mosaic._fewer_splits_that_fit(rows, ns, blocks, 230 * 1024, jnp.bfloat16,
                                                                      threads=512, block_k=32)
    assert fp8(32, 4, 20) == 3              # FP8's 32-row steps: 5 -> 7 steps a CTA, 64 entries more
    assert fp8(16, 8, 260) is None          # HCA-8K B=16: 33 -> 38 steps


def test_split_count_past_one_wave():
    """Decode rows (x head groups) beyond one CTA an SM: `wave_splits` takes the split count with the least
    estimated time where it promises WAVE_MIN_GAIN over one split a row. The estimate's order agrees with the H100's
    measurements (session 57: HCA-8K, 130 steps a row, at B = 136: 1 split 722.8 us, 2 576.7, 4 517.0, 8 528.0; at
    B = 192: 1 718.2, 2 614.2, 4 654.2), and short lists, where no count measured faster, keep one split."""
    from pallas_kernels.sparse_attention import common, gpu_mosaic

    est = lambda rows, blocks, ns: common.wave_estimate(rows, blocks, ns)
    assert est(136, 130, 4) < est(136, 130, 2) < est(136, 130, 1)
    assert est(192, 130, 2) < est(192, 130, 4) < est(192, 130, 1)
    splits = lambda rows, blocks, decode=True: gpu_mosaic.default_config(rows, blocks, decode)["n_splits"]
    assert 4 <= splits(136, 130) <= 8
    assert splits(192, 130) == 2
    assert splits(256, 130) == 1             # 256 CTAs: two nearly full waves already
    assert splits(136, 10) == splits(192, 10) == 1   # CSA: 79.8 / 100.4 us with 2 splits against 75.7 / 71.9
    assert splits(136, 18) == 1              # HCA-1K: 117.9 / 117.1 with 2 / 3 against 116.8
    assert splits(136, 130, decode=False) == 1   # prefill shapes: one split a row, as before
    assert splits(200, 1) == splits(200, 0) == 1   # nothing to split
    # FP8's tile ring counts 32-entry blocks: the same entries, the same split count
    assert gpu_mosaic.default_config(136, 260, block_k=32)["n_splits"] == splits(136, 130)
    # up to one wave: the rule of sessions 1-56 (enough splits to fill the SMs, two steps a split at least)
    for rows in (1, 16, 32, 64, 100, 128, 132):
        for blocks in (2, 10, 18, 130):
            assert splits(rows, blocks) == max(1, min(132 // rows, max(1, blocks // 2)))


def test_triton_split_count_past_one_wave():
    """The Triton kernel (every GPU's fallback) had the same cliff past one wave of programs (H100, session 58:
    HCA-8K at B = 136 1146.3 us with one split a row against 577.2 at B = 128, 743.2 with 4 splits) and takes the
    same rule: `common.wave_splits` in 64-entry steps for decode shapes; up to one wave and for prefill shapes its
    rule of before."""
    from pallas_kernels.sparse_attention import common, gpu

    splits = lambda bt, h, total_k, prefill=False, fp8=False: gpu.default_config(bt, h, total_k, fp8, prefill)["n_splits"]
    hca8k = 128 + 8192
    assert splits(136, 64, hca8k) == splits(136, 64, hca8k, fp8=True) == common.wave_splits(136, 130) > 1
    assert splits(160, 64, hca8k) == common.wave_splits(160, 130) > 1
    assert splits(72, 128, hca8k) == common.wave_splits(144, 130) > 1   # 128 heads: two head blocks a row
    assert splits(136, 64, 128 + 512) == 1                                 # CSA: short lists keep one split
    assert splits(136, 64, hca8k, prefill=True) == 1
    for bt in (1, 16, 64, 128, 132):                                       # up to one wave: as before
        assert splits(bt, 64, hca8k) == max(1, min(132 // bt, 130 // 2))
    # f32 q: 16 heads a program and 32-entry blocks; the same entries give the same split count
    assert gpu.default_config(40, 64, hca8k, False, False, q_bytes=4)["n_splits"] == common.wave_splits(160, 130)
