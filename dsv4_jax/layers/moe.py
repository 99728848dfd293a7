"""Mixture of experts (spec §3.12): hash or sqrt-softplus top-k routing, clamped SwiGLU experts, a shared expert.

Router: s = sqrt(softplus(x @ W_g.T)) in float32. Learned layers pick top-k of (s + bias) (bias steers selection
only); hash layers take `tid2eid[token_id]`. Weights = s[picked] / sum * routed_scaling_factor.
Routed experts run as grouped matmuls over tokens sorted by expert (`pallas_kernels.grouped_matmul` on GPU / TPU,
`lax.ragged_dot` on the CPU; `EXPERTS_CONFIG`), so the cost is tokens x top-k, never tokens x experts. Expert weights
are stacked [E, in, out], `ragged_dot`'s own rhs layout (and the kernels'): stacked as checkpoints hold them,
[E, out, in], XLA's GPU grouped matmul transposed the whole stack at every call (H100, V4-Flash shapes, 8 experts,
B = 16: 386.7 vs 192.9 us; `benchmarks/moe_layout.py`, session 45). The loader turns each expert's [out, in] around
once (`checkpoint.names.model_layout`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_kernels.grouped_matmul import Fp4Weights, grouped_matmul, grouped_matmul_fp4
# x [T*k, in] (ragged along T*k, grouped by expert) . w [E, in, out] -> [T*k, out]: the grouped matmul's contract
from pallas_kernels.grouped_matmul.reference import DIMS as _RAGGED_DN
from pallas_kernels.grouped_matmul.reference import precision_for

from ..config import DeepseekV4Config
from .common import Buffer, Linear, normal, param

# The routed experts' grouped matmuls: "auto" (pallas on GPU / TPU where the kernel takes the shapes, e.g. hidden
# and moe_intermediate_size multiples of 16 on the GPU; the reference on the CPU and elsewhere), "pallas"
# (pallas_kernels.grouped_matmul: a Triton kernel on the GPU, megablox on the TPU, both reading only the experts that
# have tokens) or "reference" (XLA's ragged dot, which on the GPU is a dense matmul over all E experts: E x the FLOPs
# and every expert's weights read). H100, V4-Flash shapes with its 256 experts (`benchmarks/moe_layout.py`, session
# 46): batch 16, 1446.9 us on the kernel (0.96x the weight-read floor) vs 4577.5 on ragged dot; batch 64, 3315.0 vs
# 6607.4.
EXPERTS_CONFIG = dict(grouped_matmul="auto")


def swiglu(g, u, limit: float):
    """silu(min(g, limit)) * clip(u, -limit, limit) (no clamp when limit <= 0), float32."""
    g, u = g.astype(jnp.float32), u.astype(jnp.float32)
    if limit > 0:
        g, u = jnp.minimum(g, limit), jnp.clip(u, -limit, limit)
    return jax.nn.silu(g) * u


class Gate(nnx.Module):
    def __init__(self, config: DeepseekV4Config, is_hash: bool, *, dtype, rngs: nnx.Rngs):
        E, k = config.n_routed_experts, config.num_experts_per_tok
        self.is_hash, self.top_k, self.route_scale = is_hash, k, config.routed_scaling_factor
        self.weight = param(normal(rngs, (E, config.hidden_size), config.hidden_size ** -0.5, dtype),
                            ("experts", "embed"))
        if is_hash:
            self.tid2eid = Buffer(jax.random.randint(rngs.params(), (config.vocab_size, k), 0, E, jnp.int32),
                                  out_sharding=("vocab", None), eager_sharding=False)
        else:
            self.bias = param(normal(rngs, (E,), 0.1, jnp.float32), ("experts",))

    def __call__(self, x, ids):
        """x [T, D], ids [T] -> (weights [T, k] float32, experts [T, k] int32)."""
        logits = jnp.dot(x.astype(jnp.float32), self.weight[...].astype(jnp.float32).T,
                         precision=jax.lax.Precision.HIGHEST)
        scores = jnp.sqrt(jax.nn.softplus(logits))
        if self.is_hash:
            experts = jnp.take(self.tid2eid[...], ids, axis=0)
        else:
            _, experts = jax.lax.top_k(scores + self.bias[...], self.top_k)
        w = jnp.take_along_axis(scores, experts, axis=-1)
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
        return w * self.route_scale, experts.astype(jnp.int32)


# How the model holds the routed experts: "dequantized" (w1 / w3 / w2 in the model dtype) or "fp4" (the checkpoint's
# FP4 bytes as they are, `pallas_kernels.grouped_matmul.fp4`: w1_fp4 / w1_fp4_scale ... [E, out, in/2] / [E, out,
# in/32] uint8, the checkpoint's own orientation, 4.25 bits a weight against 16; the same products, read and decoded
# inside the grouped matmul)
EXPERT_WEIGHTS = ("dequantized", "fp4")


def random_fp4_stack(rngs: nnx.Rngs, E: int, K: int, N: int, std: float):
    """Random FP4 experts of K inputs and N outputs (packed [E, N, K/2] uint8, e8m0 scales [E, N, K/32] uint8) whose
    values have about `std`: uniform nibbles (rms 2.93 over the 16 codes) times one power of two."""
    packed = jax.random.randint(rngs.params(), (E, N, K // 2), 0, 256, jnp.int32).astype(jnp.uint8)
    s = 127 + int(round(np.log2(std / 2.93)))
    return packed, jnp.full((E, N, K // 32), s, jnp.uint8)


class Experts(nnx.Module):
    """Routed experts stacked along a leading expert axis, [E, in, out]: w1, w3 [E, D, I]; w2 [E, I, D]
    (checkpoints hold each expert's [out, in]; see the module docstring). expert_weights "fp4" (`EXPERT_WEIGHTS`):
    w{1,3,2}_fp4 (packed e2m1) and w{1,3,2}_fp4_scale (e8m0) instead, in the checkpoint's [E, out, in / 2] and
    [E, out, in / 32] (`grouped_matmul.Fp4Weights`)."""

    def __init__(self, config: DeepseekV4Config, *, dtype, rngs: nnx.Rngs, expert_weights: str = "dequantized"):
        E, I, D = config.n_routed_experts, config.moe_intermediate_size, config.hidden_size
        if expert_weights not in EXPERT_WEIGHTS:
            raise ValueError(f"expert_weights must be one of {EXPERT_WEIGHTS}, got {expert_weights!r}")
        self.limit = config.swiglu_limit
        self.fp4 = expert_weights == "fp4"
        for name, (K, N), axes in (("w1", (D, I), ("experts", "embed", "mlp")),
                                   ("w3", (D, I), ("experts", "embed", "mlp")),
                                   ("w2", (I, D), ("experts", "mlp", "embed"))):
            if not self.fp4:
                setattr(self, name, param(normal(rngs, (E, K, N), K ** -0.5, dtype), axes))
                continue
            if K % 32:
                raise ValueError(f"expert_weights='fp4' needs hidden_size and moe_intermediate_size multiples of 32 "
                                 f"(e8m0 scales per 32 inputs), got {K}")
            packed, scales = random_fp4_stack(rngs, E, K, N, K ** -0.5)
            fp4_axes = (axes[0], axes[2], axes[1])                                  # [E, out, in / 2]
            setattr(self, f"{name}_fp4", param(packed, fp4_axes))
            setattr(self, f"{name}_fp4_scale", param(scales, fp4_axes))

    def weights(self):
        """(w1, w3, w2): arrays [E, in, out], or `Fp4Weights` with expert_weights "fp4"."""
        if not self.fp4:
            return self.w1[...], self.w3[...], self.w2[...]
        return tuple(Fp4Weights(getattr(self, f"{n}_fp4")[...], getattr(self, f"{n}_fp4_scale")[...])
                     for n in ("w1", "w3", "w2"))

    def __call__(self, x, weights, experts):
        """x [T, D], weights/experts [T, k] -> sum_k weights * expert_k(x) [T, D] float32."""
        return routed_experts(x, weights, experts, *self.weights(), self.limit)


def routed_experts(x, weights, experts, w1, w3, w2, limit: float, dims=_RAGGED_DN, gmm_impl=None,
                   gmm_options=None):
    """x [T, D], weights/experts [T, k], stacked expert weights -> sum_k weights * expert_k(x) [T, D] float32.
    `dims`: how x [T*k, in] contracts with a weight stack; the default takes the model's [E, in, out]
    (benchmarks/moe_layout.py also times the checkpoints' [E, out, in] with the same math). `gmm_impl`: the grouped
    matmul's impl (`pallas_kernels.grouped_matmul`; None: EXPERTS_CONFIG's), [E, in, out] weights only, with the
    kernel options `gmm_options` (benchmarks). w1, w3, w2 may also be `Fp4Weights` (the checkpoint's FP4 bytes,
    `grouped_matmul.fp4`; a model with expert_weights "fp4"), products in x's dtype."""
    T, k = experts.shape
    E = w1.shape[0]
    fp4 = isinstance(w1, Fp4Weights)                                                # the checkpoint's FP4 bytes
    dtype = x.dtype if fp4 else w1.dtype                                            # the products' dtype
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // k
    xs = jnp.take(x, token, axis=0).astype(dtype)                                  # [T*k, D] grouped by expert
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
    gmm_impl = EXPERTS_CONFIG["grouped_matmul"] if gmm_impl is None else gmm_impl
    if dims == _RAGGED_DN:   # the grouped-matmul dispatchers ("reference": XLA's ragged dot with these dims)
        gmm = grouped_matmul_fp4 if fp4 else grouped_matmul
        dot = lambda a, w: gmm(a, w, sizes, impl=gmm_impl, **(gmm_options or {}))
    elif fp4 or gmm_impl != "reference":
        raise ValueError(f"routed_experts: the grouped-matmul kernels and FP4 weights take [E, in, out] weights (the "
                         f"default dims); gmm_impl={gmm_impl!r} with other dims needs gmm_impl='reference'")
    else:   # other dims (benchmarks: the checkpoints' [E, out, in]), the reference's precision rule
        dot = lambda a, w: jax.lax.ragged_dot_general(a, w, sizes, dims, precision=precision_for(w.dtype),
                                                      preferred_element_type=jnp.float32)
    h = swiglu(dot(xs, w1), dot(xs, w3), limit)
    y = dot(h.astype(dtype), w2)                                                    # [T*k, D] float32
    y = y * jnp.take(weights.reshape(-1), order)[:, None]
    return jnp.zeros((T, x.shape[-1]), jnp.float32).at[token].add(y)


class SharedExpert(nnx.Module):
    def __init__(self, config: DeepseekV4Config, *, dtype, rngs: nnx.Rngs):
        D, I = config.hidden_size, config.moe_intermediate_size
        self.limit = config.swiglu_limit
        self.w1 = Linear(D, I, dtype=dtype, rngs=rngs, axes=("mlp", "embed"))
        self.w3 = Linear(D, I, dtype=dtype, rngs=rngs, axes=("mlp", "embed"))
        self.w2 = Linear(I, D, dtype=dtype, rngs=rngs, axes=("embed", "mlp"))

    def __call__(self, x):
        h = swiglu(self.w1(x, jnp.float32), self.w3(x, jnp.float32), self.limit)
        return self.w2(h.astype(x.dtype), jnp.float32)


class MoE(nnx.Module):
    def __init__(self, config: DeepseekV4Config, layer_idx: int, *, dtype, rngs: nnx.Rngs,
                 expert_weights: str = "dequantized"):
        self.gate = Gate(config, config.is_hash_layer(layer_idx), dtype=dtype, rngs=rngs)
        self.experts = Experts(config, dtype=dtype, rngs=rngs, expert_weights=expert_weights)
        self.shared_experts = SharedExpert(config, dtype=dtype, rngs=rngs) if config.n_shared_experts else None

    def __call__(self, x, ids):
        """x [B, S, D], ids [B, S] -> [B, S, D] in x.dtype."""
        B, S, D = x.shape
        flat = x.reshape(B * S, D)
        w, e = self.gate(flat, ids.reshape(-1))
        y = self.experts(flat, w, e)
        if self.shared_experts is not None:
            y = y + self.shared_experts(flat)
        return y.reshape(B, S, D).astype(x.dtype)
