"""The grouped matmul's contract, in plain jnp (XLA's ragged dot).

    grouped_matmul(lhs [M, K], rhs [E, K, N], group_sizes [E] int32) -> [M, N] float32

Rows of lhs are sorted by group: rows [offset_e, offset_e + group_sizes[e]) (offset_e = the sizes before e) are
multiplied by rhs[e]; rows past sum(group_sizes) give 0. Products in lhs's / rhs's dtype (f32 ones in f32, not TF32),
f32 accumulation.

Why a kernel of our own (session 45, H100, the optimized HLO in `benchmarks/results/h100_s45r1_moe_hlo/`): XLA's
GPU compiler turns `ragged_dot` into a dense matmul, lhs masked and broadcast to [M, E, K] against rhs as one
[E * K, N] matrix. So every call reads all E experts' weights and does E x the FLOPs, which 8 experts (the
benchmarks' slice) hide but 256 (V4-Flash) would not: at decode, batch 16 x top-6, ~80 of 256 experts are active.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

DIMS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [1]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])


def check_operands(lhs, rhs, group_sizes):
    """The kernels' argument check: lhs [M, K], rhs [E, K, N], group_sizes [E], lhs and rhs of one dtype."""
    M, K = lhs.shape
    E, K2, N = rhs.shape
    if K2 != K or group_sizes.shape != (E,):
        raise ValueError(f"grouped_matmul: lhs [M, K], rhs [E, K, N] and group_sizes [E] must agree, got lhs "
                         f"{lhs.shape}, rhs {rhs.shape}, group_sizes {group_sizes.shape}")
    if lhs.dtype != rhs.dtype:
        raise ValueError(f"grouped_matmul: lhs and rhs must share a dtype, got {lhs.dtype} and {rhs.dtype}")
    return M, K, E, N


def precision_for(dtype):
    """The matmul precision of the contract: f32 operands multiply in f32 (the GPU's default for f32 is TF32, ~1e-3
    relative; the first GPU run of the model's f32 test differed from the kernel by 6e-4), narrower dtypes as they
    are (their products are exact in f32)."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def grouped_matmul(lhs, rhs, group_sizes):
    """lhs [M, K], rhs [E, K, N], group_sizes [E] int32 -> [M, N] float32 (module doc)."""
    return jax.lax.ragged_dot_general(lhs, rhs, group_sizes.astype(jnp.int32), DIMS,
                                      precision=precision_for(lhs.dtype), preferred_element_type=jnp.float32)
