"""The ctypes mirror of CUDA's launch-config structs (cluster_occupancy.py) keeps the driver ABI's layout, and the
query degrades to None where no CUDA driver answers (the caller then takes the XLA merge). The query itself runs
on the GPU: test_sparse_attention_gpu.py::test_gpu_cluster_occupancy_query."""

import ctypes

import pytest

from pallas_kernels.sparse_attention import cluster_occupancy as co


def test_launch_structs_match_the_driver_abi():
    # CUlaunchAttribute: 4 B id, 4 B pad, 64 B value union; CUlaunchConfig: 7 x u32, (pad), stream, attrs, numAttrs
    assert ctypes.sizeof(co._AttrValue) == 64
    assert ctypes.sizeof(co._Attr) == 72 and co._Attr.value.offset == 8
    assert co._LaunchConfig.hStream.offset == 32 and co._LaunchConfig.attrs.offset == 40
    assert co._LaunchConfig.numAttrs.offset == 48 and ctypes.sizeof(co._LaunchConfig) == 56


def _has_cuda_driver():
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


@pytest.mark.skipif(_has_cuda_driver(), reason="a CUDA driver is installed: it may answer (see the GPU test)")
def test_no_driver_no_answer():
    co.max_active_clusters.cache_clear()
    assert co.max_active_clusters(2, 200 * 1024) is None
