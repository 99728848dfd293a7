"""How many thread-block clusters of a given size fit on the GPU at once (CUDA's `cuOccupancyMaxActiveClusters`).

The Mosaic attention kernel's in-kernel split-K merge (`combine="cluster"`) runs a row's splits as one cluster. A
cluster's CTAs must all sit in one GPC, and with one CTA per SM (the kernel takes ~200 KB of shared memory) how many
clusters fit depends on the chip's per-GPC SM counts, which floor-sweeping makes uneven. Measured on the H200
(132 SMs, session 16): 64 clusters of 2 fit in one wave, 32 of 4 do not, 16 of 5 and of 6 do, 16 of 7 and of 8 do
not; a cluster grid that does not fit runs in two waves and takes twice the time. So the kernel's default asks the
driver, for this device, instead of a table.

The query needs a function to ask about: a one-instruction PTX kernel with the same block size and dynamic shared
memory, loaded through the driver API (ctypes; nothing is launched). Returns None where there is no CUDA driver or
the query fails (CPU, lowering tests), and the caller then does not pick clusters by default.
"""

from __future__ import annotations

import ctypes
import functools

_PTX = b""".version 8.0
.target sm_90
.address_size 64
.visible .entry dsv4_cluster_probe() { ret; }
"""
_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
_CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4


class _Dim3(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]


class _AttrValue(ctypes.Union):        # CUlaunchAttributeValue: a 64-byte union
    _fields_ = [("pad", ctypes.c_char * 64), ("clusterDim", _Dim3)]


class _Attr(ctypes.Structure):         # CUlaunchAttribute: id, 4 bytes of padding, value
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _AttrValue)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_Attr)), ("numAttrs", ctypes.c_uint)]


def _check(rc, what):
    if rc != 0:
        raise RuntimeError(f"{what} returned CUresult {rc}")


@functools.lru_cache(maxsize=None)
def max_active_clusters(cluster_size: int, smem_bytes: int, threads: int = 384, device_ordinal: int = 0):
    """The number of (1, cluster_size, 1) clusters of `threads`-thread CTAs with `smem_bytes` of dynamic shared
    memory each that can be resident on CUDA device `device_ordinal` at once, or None if it cannot be asked."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    dev, ctx, mod, fn = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
    pushed = False
    try:
        _check(cuda.cuInit(0), "cuInit")
        _check(cuda.cuDeviceGet(ctypes.byref(dev), device_ordinal), "cuDeviceGet")
        _check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
        _check(cuda.cuCtxPushCurrent_v2(ctx), "cuCtxPushCurrent")
        pushed = True
        _check(cuda.cuModuleLoadData(ctypes.byref(mod), ctypes.c_char_p(_PTX)), "cuModuleLoadData")
        _check(cuda.cuModuleGetFunction(ctypes.byref(fn), mod, b"dsv4_cluster_probe"), "cuModuleGetFunction")
        _check(cuda.cuFuncSetAttribute(fn, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, int(smem_bytes)),
               "cuFuncSetAttribute")
        attr = _Attr(id=_CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION)
        attr.value.clusterDim = _Dim3(1, int(cluster_size), 1)
        cfg = _LaunchConfig(1, int(cluster_size), 1, int(threads), 1, 1, int(smem_bytes), None,
                            ctypes.pointer(attr), 1)
        n = ctypes.c_int()
        _check(cuda.cuOccupancyMaxActiveClusters(ctypes.byref(n), fn, ctypes.byref(cfg)),
               "cuOccupancyMaxActiveClusters")
        return int(n.value)
    except (RuntimeError, AttributeError):
        return None
    finally:
        if mod.value:
            cuda.cuModuleUnload(mod)
        if pushed:
            cuda.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
        if ctx.value:
            cuda.cuDevicePrimaryCtxRelease_v2(dev)
