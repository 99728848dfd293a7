"""Shared building blocks: parameters with logical axis names, [out, in] linears, RMSNorm, embedding.

Every parameter carries logical axis names (`sharding_names` metadata: "vocab", "embed", "heads", "experts", ...)
so a later mesh rule can shard the whole model with `nnx.get_partition_spec` without touching the modules.
Weights keep the checkpoint's [out, in] orientation (y = x @ W.T): loading is a rename, never a transpose.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx


class Buffer(nnx.Variable):
    """A non-trainable integer table that belongs to the checkpoint (e.g. the hash router's `tid2eid`)."""


def param(value: jax.Array, axes: tuple) -> nnx.Param:
    """An nnx.Param tagged with logical axis names (metadata only; no eager sharding)."""
    assert len(axes) == value.ndim, (axes, value.shape)
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


def normal(rngs: nnx.Rngs, shape, std: float, dtype) -> jax.Array:
    """A fresh parameter ~ N(0, std^2) [shape] in `dtype`, from the next `params` key.

    Drawn as the first prod(shape) values of a standard-normal vector whose length is rounded up to a power of two
    (tensors up to 2^24 values; larger ones exactly): the threefry normal compiles per length (0.4-0.8 s each on
    XLA:CPU), so the tiny test config's 23 parameter shapes cost 16 s of compiles; they now draw from 5 lengths
    (6 s, the slice-and-scale program per shape being cheap). Eager and traced construction (nnx.eval_shape,
    nnx.jit) take the same path, so a seed gives the same weights either way."""
    size = math.prod(shape)
    n = max(1 << max(size - 1, 0).bit_length(), 1024) if size <= _BUCKETED_MAX else size
    return _scaled_prefix(_standard_normal(rngs.params(), n), std, shape=tuple(shape), dtype=dtype)


_BUCKETED_MAX = 1 << 24


@functools.partial(jax.jit, static_argnums=1, inline=True)
def _standard_normal(key, n):
    return jax.random.normal(key, (n,), jnp.float32)


@functools.partial(jax.jit, static_argnames=("shape", "dtype"), inline=True)
def _scaled_prefix(flat, std, *, shape, dtype):
    return (flat[:math.prod(shape)].reshape(shape) * std).astype(dtype)


def matmul(x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
    """x [..., in] @ w[out, in].T with float32 accumulation; result in `out_dtype` (default x.dtype)."""
    y = jax.lax.dot_general(x.astype(w.dtype), w, (((x.ndim - 1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32)
    return y.astype(out_dtype or x.dtype)


def matmul_heads(x: jax.Array, w: jax.Array, n_heads: int, out_dtype=None) -> jax.Array:
    """`matmul(x, w).reshape(..., n_heads, head_dim)` as one dot against w viewed [n_heads, head_dim, in]: the same
    products and f32 sums, written straight into [..., n_heads, head_dim]. On a TPU the flat [..., n_heads *
    head_dim] result had to be re-tiled into the per-head shape's (8, 128) tiles: 134 MB of copies for a V4-Flash
    indexer's q over an 8 x 512-token chunk (session 53), none with the dot. (The attention's own q projection
    gained nothing from it: its norm and RoPE fusions re-tile q anyway, 268 MB either way.)"""
    w3 = w.reshape(n_heads, w.shape[0] // n_heads, w.shape[1])
    y = jax.lax.dot_general(x.astype(w.dtype), w3, (((x.ndim - 1,), (2,)), ((), ())),
                            preferred_element_type=jnp.float32)
    return y.astype(out_dtype or x.dtype)


class Linear(nnx.Module):
    """y = x @ weight.T, weight [out_features, in_features] (checkpoint orientation)."""

    def __init__(self, in_features: int, out_features: int, *, dtype, rngs: nnx.Rngs, axes=(None, None)):
        self.weight = param(normal(rngs, (out_features, in_features), in_features ** -0.5, dtype), axes)

    def __call__(self, x: jax.Array, out_dtype=None) -> jax.Array:
        """x [..., in] -> [..., out] in `out_dtype` (default x.dtype)."""
        return matmul(x, self.weight[...], out_dtype)


def pin_row_major(x: jax.Array, active: bool) -> jax.Array:
    """x with its layout pinned row-major where `active` (the layer's Pallas kernels run on a TPU), else x.

    A Pallas TPU kernel takes its operands row-major. XLA's TPU layout assignment does not see that demand
    upstream of the kernel's own slices and pads: for the attention q / o chain of a prefill chunk it kept S as the
    minor dim and relaid out each [B, S, H, 512] tensor into and out of the kernel (session 52: pinning q after its
    projection, q into the kernel and o out of it cut a V4-Flash CSA layer's 4K-token chunk from 3.18 to 2.00 GB of
    relayouts; `benchmarks/results/README_tpu.md`). GPU and CPU layouts are row-major already."""
    if not active:
        return x
    from jax.experimental.layout import Layout, with_layout_constraint

    return with_layout_constraint(x, Layout(major_to_minor=tuple(range(x.ndim))))


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    """Weightless RMS normalisation over the last axis, computed in float32, returned in float32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
    """RMSNorm with a float32 weight [dim]; float32 compute, output in the input dtype."""

    def __init__(self, dim: int, eps: float, *, rngs: nnx.Rngs, axis_name=None):
        self.eps = eps
        self.weight = param(1.0 + normal(rngs, (dim,), 0.1, jnp.float32), (axis_name,))

    def __call__(self, x: jax.Array) -> jax.Array:
        return (rms_normalize(x, self.eps) * self.weight[...]).astype(x.dtype)


class Embedding(nnx.Module):
    """Token embedding table weight [vocab, hidden]."""

    def __init__(self, vocab: int, dim: int, *, dtype, rngs: nnx.Rngs):
        self.weight = param(normal(rngs, (vocab, dim), 1.0, dtype), ("vocab", "embed"))

    def __call__(self, ids: jax.Array) -> jax.Array:
        """ids [B, S] int32 -> [B, S, hidden]."""
        return jnp.take(self.weight[...], ids, axis=0)
