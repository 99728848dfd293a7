"""Grouped matmul (the routed experts' GEMMs): dispatcher over the jnp reference and the Pallas kernel.

    grouped_matmul(lhs [M, K], rhs [E, K, N], group_sizes [E] int32, *, impl="reference", **kernel_options)
        -> [M, N] float32

impl: "reference" (`reference.grouped_matmul`: XLA's ragged dot), "pallas" (GPU: the Triton-backend kernel of
`gpu.py`; TPU: jax's Mosaic-TPU grouped matmul, megablox, called by `tpu.py`; CPU: the GPU kernel in the Pallas
interpreter, for tests; "interpret_tpu": the TPU one there), "auto" (pallas on GPU / TPU where the kernel takes the
shapes, `gpu.kernel_applies` / `tpu.kernel_applies`: K and N multiples of 16 on the GPU; the reference on the CPU and
for other shapes, so every model config runs). "pallas" with shapes the kernel does not take raises.

Status: the GPU kernel is the model's default since session 46 (`dsv4_jax.layers.moe.EXPERTS_CONFIG` "auto"): on
an H100 with V4-Flash's 256 experts it took batch 16's routed experts from 4577.5 us (ragged dot) to 1446.9 (0.96x
the active experts' weight-read floor), and the H200's whole 4-layer decode step from 13999.5 to 4736.9 us
(`benchmarks/moe_layout.py`, `benchmarks/decode.py`; `benchmarks/results/README_decode.md`). The TPU one (megablox)
is checked in the interpreter and by its TPU lowering only; no TPU here.

`fp4.py`: the same with the checkpoint's FP4 expert weights read as they are (`grouped_matmul_fp4`, `Fp4Weights`,
the checkpoint's [E, out, in / 2] bytes), 3.8x fewer bytes than bf16 for the decode step's largest read, decoded in
the kernel by inline PTX (TPU: `tpu.grouped_matmul_fp4_tpu`, decoded in VMEM, interpreter and lowering only); the
model's `expert_weights="fp4"`. Sessions 47-48, H100: batch 16's routed experts in 1099.0 us against 1444.8 for the
bf16-weight kernel (1.31x), 2.7x the FP4 bytes' floor (bound by the decode's instructions and their latency); at
prefill up to 1.5x slower than the bf16-weight kernel.
"""

from __future__ import annotations

from ..dispatch import resolve_impl as _resolve
from ..dispatch import run_resolved
from . import gpu as _gpu
from . import tpu as _tpu
from .fp4 import Fp4Weights, grouped_matmul_fp4
from .gpu import DEFAULT_CONFIG, grouped_matmul_gpu, work_items
from .reference import grouped_matmul as grouped_matmul_reference
from .tpu import grouped_matmul_tpu

__all__ = ["DEFAULT_CONFIG", "Fp4Weights", "grouped_matmul", "grouped_matmul_fp4", "grouped_matmul_gpu",
           "grouped_matmul_reference", "grouped_matmul_tpu", "work_items"]


def grouped_matmul(lhs, rhs, group_sizes, *, impl: str = "reference", **kernel_options):
    """Same contract as `reference.grouped_matmul`; `impl` and `kernel_options` (GPU: block_m, block_n, block_k,
    num_warps, num_stages of `gpu.grouped_matmul_gpu`; TPU: tiling of `tpu.grouped_matmul_tpu`) as the module doc
    says."""
    where = _resolve(impl, "grouped_matmul", extra=("interpret_tpu",))
    K, N = rhs.shape[-2:]
    return run_resolved(where, impl, "grouped_matmul", kernel_options,
                        applies=lambda w: (_gpu if w == "gpu" else _tpu).kernel_applies(K, N),
                        reference=lambda: grouped_matmul_reference(lhs, rhs, group_sizes),
                        gpu=lambda **kw: grouped_matmul_gpu(lhs, rhs, group_sizes, **kw),
                        tpu=lambda **kw: grouped_matmul_tpu(lhs, rhs, group_sizes, **kw))
