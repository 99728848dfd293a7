"""The grouped matmul on the TPU: jax's Mosaic-TPU grouped matmul (`jax.experimental.pallas.ops.tpu.megablox.gmm`),
called with our contract.

    grouped_matmul_tpu(lhs [M, K], rhs [E, K, N], group_sizes [E], *, tiling=None, interpret=False)
        -> [M, N] float32

megablox visits only the (group, tile) pairs that hold rows, as our GPU kernel does. It needs M, K and N to be
multiples of the tiling (default (128, 128, 128), shrunk to small K / N here); M is padded inside. Rows past
sum(group_sizes) are set to 0 (the reference's result there). f32 operands multiply in f32 as the contract says
(megablox's dot takes jax's default matmul precision, one bf16 pass on the TPU, so it is traced under "highest").
Tested in Pallas' TPU interpreter and by its TPU lowering only (no TPU here).
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp

from .reference import check_operands


def kernel_applies(K: int, N: int) -> bool:
    """Whether megablox takes [.., K] x [E, K, N] with the default tiling (K and N multiples of min(128, K / N));
    impl "auto" runs the reference elsewhere."""
    return K % min(128, K) == 0 and N % min(128, N) == 0


@functools.partial(jax.jit, static_argnames=("tiling", "interpret"))
def grouped_matmul_tpu(lhs, rhs, group_sizes, *, tiling=None, interpret=False):
    from jax.experimental.pallas.ops.tpu.megablox import gmm

    M, K, E, N = check_operands(lhs, rhs, group_sizes)
    tm, tk, tn = tiling or (128, min(128, K), min(128, N))
    if K % tk or N % tn:
        raise ValueError(f"grouped_matmul (TPU): K = {K} and N = {N} must be multiples of the tiling {(tm, tk, tn)}")
    m_pad = -(-M // tm) * tm
    lhs_p = jnp.pad(lhs, ((0, m_pad - M), (0, 0))) if m_pad != M else lhs
    f32 = jnp.dtype(lhs.dtype) == jnp.float32
    with jax.default_matmul_precision("highest") if f32 else contextlib.nullcontext():
        out = gmm(lhs_p, rhs, group_sizes.astype(jnp.int32), preferred_element_type=jnp.float32,
                  tiling=(tm, tk, tn), interpret=interpret)
    total = jnp.sum(jnp.maximum(group_sizes, 0))
    return jnp.where(jnp.arange(M)[:, None] < total, out[:M], 0.0)
