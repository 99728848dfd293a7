"""Grouped matmul (the routed experts' GEMMs): dispatcher over the jnp reference and the Pallas kernel.

    grouped_matmul(lhs [M, K], rhs [E, K, N], group_sizes [E] int32, *, impl="reference", **kernel_options)
        -> [M, N] float32

impl: "reference" (`reference.grouped_matmul`: XLA's ragged dot), "pallas" (GPU: the Triton-backend kernel of
`gpu.py`; CPU: the same kernel in the Pallas interpreter, for tests; TPU: the reference, XLA's TPU ragged dot, which
no measurement here has questioned), "auto" (pallas on the GPU, the reference elsewhere).

Status (session 45): the kernel is written and checked against the reference in the interpreter and by its CUDA
lowering, but not yet run on a GPU, so the model keeps the reference until it is timed there
(`dsv4_jax.layers.moe.EXPERTS_CONFIG`, `benchmarks/moe_layout.py --variants in_out,in_out_pallas`).
"""

from __future__ import annotations

from ..dispatch import resolve_impl as _resolve
from .gpu import DEFAULT_CONFIG, grouped_matmul_gpu, work_items
from .reference import grouped_matmul as grouped_matmul_reference

__all__ = ["DEFAULT_CONFIG", "grouped_matmul", "grouped_matmul_gpu", "grouped_matmul_reference", "work_items"]


def grouped_matmul(lhs, rhs, group_sizes, *, impl: str = "reference", **kernel_options):
    """Same contract as `reference.grouped_matmul`; `impl` and `kernel_options` (block_m, block_n, block_k,
    num_warps, num_stages of `gpu.grouped_matmul_gpu`) as the module doc says."""
    where = _resolve(impl, "grouped_matmul")
    if where in ("reference", "tpu"):
        if kernel_options:
            raise ValueError(f"grouped_matmul: kernel options {sorted(kernel_options)} apply to the GPU kernel only "
                             f"(impl={impl!r} runs the reference here)")
        return grouped_matmul_reference(lhs, rhs, group_sizes)
    return grouped_matmul_gpu(lhs, rhs, group_sizes, interpret=where == "interpret", **kernel_options)
