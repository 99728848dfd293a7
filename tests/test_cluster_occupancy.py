"""The ctypes mirror of CUDA's launch-config structs (cluster_occupancy.py) keeps the driver ABI's layout, and the
query degrades to None where no CUDA driver answers (the caller then takes the XLA merge). The query itself runs
on the GPU: test_sparse_attention_gpu.py::test_gpu_cluster_occupancy_query."""

import ctypes

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
