"""The split-K combine as one Pallas (Triton) kernel; its plain-jnp reference is `common.combine_splits`.

Split-K decode leaves, per query row r and split s, a partial output o_s [H, D] normalised by its own softmax sum
and that sum's log, lse_s [H] (natural log, -inf for a split that saw no entry). The merge is

    m = max(sink, max_s lse_s),  w_s = exp(lse_s - m),  o = sum_s w_s o_s / (sum_s w_s + exp(sink - m)),
    lse = log(sum_s w_s) + m  (-inf where every split is empty).

XLA turns `common.combine_splits` into two kernels on the GPU: the [.., S, H] weights, then the pass over the
partials (H200, session 15: 1.1-1.5 us + 2.2-3.5 us per decode call at B = 16-64, next to a 13-27 us attention
kernel, and a launch gap between them). Here one program per (row, block of heads) computes its weights in
registers from the S lse rows and streams the S partial tiles [heads, D] once: one kernel, the partials read once,
the output written once. Same float32 arithmetic as the reference (up to the order of the S-term sums, which is
the same: s = 0, 1, ...).

Invariants: S is static and small (a Python loop over it); D and the head block are powers of two (Triton
tiles); an empty split's weight is exactly 0, so its partial (any finite value) contributes nothing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .common import combine_splits

try:
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover
    plgpu = None

COMBINES = ("xla", "pallas")
# H200 (session 16): "pallas" saves ~1 us per call at 2 splits and loses ~1 us at 8, within the calls' spread, so
# the XLA merge stays the default (the Mosaic kernel merges in the kernel instead: gpu_mosaic's combine="cluster")
DEFAULT_COMBINE = "xla"


def _pow2(n: int) -> bool:
    return n > 0 and not n & (n - 1)


def default_heads_per_block(h: int) -> int:
    """8 heads per program (a [8, 512] float32 accumulator is 32 registers per thread at 4 warps), or the largest
    power of two dividing h below that."""
    hb = 8
    while h % hb:
        hb //= 2
    return hb


def _kernel(lse_ref, sink_ref, o_ref, out_ref, lse_out_ref, *, n_splits: int):
    """lse_ref [1, S, hb] f32, sink_ref [hb] f32, o_ref [1, S, hb, D] -> out_ref [1, hb, D], lse_out_ref [1, hb]."""
    sink = sink_ref[...]
    m = sink
    for s in range(n_splits):
        m = jnp.maximum(m, lse_ref[0, s, :])
    sw = jnp.zeros_like(m)
    acc = None
    for s in range(n_splits):
        w = jnp.exp(lse_ref[0, s, :] - m)                      # [hb]; 0 for an empty split
        sw = sw + w
        term = w[:, None] * o_ref[0, s, :, :].astype(jnp.float32)
        acc = term if acc is None else acc + term
    inv = 1.0 / (sw + jnp.exp(sink - m))
    out_ref[0, :, :] = (acc * inv[:, None]).astype(out_ref.dtype)
    lse_out_ref[0, :] = jnp.where(sw > 0, jnp.log(sw) + m, -jnp.inf)


def combine_splits_pallas(o_parts, lse_parts, sinks, out_dtype, *, heads_per_block: int | None = None,
                          num_warps: int = 4, interpret: bool = False):
    """Same contract as `common.combine_splits` for o_parts [N, S, H, D] (any float dtype), lse_parts [N, S, H],
    sinks [H]. Returns (o [N, H, D] out_dtype, lse [N, H] float32)."""
    if getattr(o_parts, "ndim", None) != 4:
        raise ValueError(f"o_parts must be [rows, splits, heads, head_dim], got {getattr(o_parts, 'shape', None)}")
    n, s, h, d = o_parts.shape
    if tuple(lse_parts.shape) != (n, s, h):
        raise ValueError(f"lse_parts must be [rows={n}, splits={s}, heads={h}], got {tuple(lse_parts.shape)}")
    if tuple(sinks.shape) != (h,):
        raise ValueError(f"sinks must be [heads={h}], got {tuple(sinks.shape)}")
    hb = heads_per_block or default_heads_per_block(h)
    if not _pow2(hb) or h % hb:
        raise ValueError(f"heads_per_block must be a power of two dividing heads={h}, got {hb}")
    if not _pow2(d):
        raise ValueError(f"the Pallas combine needs a power-of-two head_dim (Triton tiles), got {d}; use combine='xla'")
    extra = {}
    if not interpret:
        extra["compiler_params"] = plgpu.CompilerParams(num_warps=num_warps, num_stages=1)
    o, lse = pl.pallas_call(
        functools.partial(_kernel, n_splits=s),
        grid=(n, h // hb),
        in_specs=[pl.BlockSpec((1, s, hb), lambda r, j: (r, 0, j)),
                  pl.BlockSpec((hb,), lambda r, j: (j,)),
                  pl.BlockSpec((1, s, hb, d), lambda r, j: (r, 0, j, 0))],
        out_specs=[pl.BlockSpec((1, hb, d), lambda r, j: (r, j, 0)),
                   pl.BlockSpec((1, hb), lambda r, j: (r, j))],
        out_shape=[jax.ShapeDtypeStruct((n, h, d), jnp.dtype(out_dtype)),
                   jax.ShapeDtypeStruct((n, h), jnp.float32)],
        interpret=interpret,
        name=f"combine_splits_s{s}_hb{hb}",
        **extra,
    )(lse_parts.astype(jnp.float32), sinks.astype(jnp.float32), o_parts)
    return o, lse


def resolve(how: str | None) -> str:
    """`how` checked (None = DEFAULT_COMBINE); the kernels call this up front, split-K or not."""
    how = how or DEFAULT_COMBINE
    if how == "cluster":
        raise ValueError("combine='cluster' (the merge inside the kernel, through a thread-block cluster) is the "
                         "Mosaic GPU kernel's: kernel='mosaic', or combine='xla' / 'pallas'")
    if how not in COMBINES:
        raise ValueError(f"combine must be one of {COMBINES}, got {how!r}")
    return how


def combine(o_parts, lse_parts, sinks, out_dtype, *, how: str | None = None, interpret: bool = False):
    """The split-K merge by `how` ("xla": `common.combine_splits`; "pallas": `combine_splits_pallas`; None =
    DEFAULT_COMBINE). o_parts [..., S, H, D] with any leading dims for "xla", [N, S, H, D] for "pallas"."""
    if resolve(how) == "xla":
        return combine_splits(o_parts, lse_parts, sinks, out_dtype)
    return combine_splits_pallas(o_parts, lse_parts, sinks, out_dtype, interpret=interpret)
