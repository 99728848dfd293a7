"""A block-wide histogram for Pallas Triton kernels: Triton's `tt.histogram`, which Pallas does not expose.

    histogram(values [N] int32, num_bins, mask=None [N] bool) -> counts [num_bins] int32
        counts[b] = #{i : mask[i] and values[i] == b}; values outside [0, num_bins) are not counted.

Inside a Triton kernel it lowers to one `tt.histogram` op: on NVIDIA, a shared-memory histogram of `num_bins`
int32 counters filled by one predicated shared-memory atomic add per element (Triton's HistogramOpToLLVM; small
bin counts use warp ballots instead), between two CTA barriers. One call counts a whole in-register block in one
step, where counting digit by digit needs a block-wide reduction per digit: what a radix select with 11-bit digits
needs (`topk_hist`). Elements hitting the same counter serialize in the atomics, so a histogram is as fast as its
values are spread: callers mask out values they know are irrelevant (e.g. -inf scores) rather than count them.

The mask is folded into the values (masked lanes get `num_bins`, which the lowering's unsigned range check skips),
so the op is emitted without its optional mask operand. Outside a Triton kernel (XLA, and the Pallas interpreter
in the CPU tests) the primitive is the scatter-add of `histogram_reference`: same counts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.interpreters import mlir

try:
    from jax.extend.core import Primitive
except ImportError:  # pragma: no cover - older jax
    from jax.core import Primitive

__all__ = ["histogram", "histogram_reference", "histogram_p"]

histogram_p = Primitive("dsv4_block_histogram")


def histogram_reference(values, num_bins: int, mask=None):
    """values [N] int -> counts [num_bins] int32 (the contract above), in plain jnp."""
    values = jnp.asarray(values, jnp.int32)
    ok = (values >= 0) & (values < num_bins)
    if mask is not None:
        ok = ok & mask
    return jnp.zeros((num_bins,), jnp.int32).at[jnp.where(ok, values, num_bins)].add(1, mode="drop")


def histogram(values, num_bins: int, mask=None):
    """values [N] int32 (any int dtype is cast), mask [N] bool or None -> counts [num_bins] int32; see module doc."""
    values = jnp.asarray(values)
    if values.ndim != 1:
        raise ValueError(f"histogram: values must be 1-D, got shape {values.shape}")
    if not jnp.issubdtype(values.dtype, jnp.integer):
        raise TypeError(f"histogram: values must be integers, got {values.dtype}")
    num_bins = int(num_bins)
    if num_bins < 1 or num_bins & (num_bins - 1):
        raise ValueError(f"histogram: num_bins must be a power of two (Triton's rule), got {num_bins}")
    values = values.astype(jnp.int32)
    if mask is not None:
        if mask.shape != values.shape:
            raise ValueError(f"histogram: mask shape {mask.shape} != values shape {values.shape}")
        values = jnp.where(mask, values, jnp.int32(num_bins))   # masked lanes: out of range, not counted
    return histogram_p.bind(values, num_bins=num_bins)


@histogram_p.def_abstract_eval
def _abstract_eval(values, *, num_bins):
    return jax.core.ShapedArray((num_bins,), jnp.int32)


histogram_p.def_impl(lambda values, *, num_bins: histogram_reference(values, num_bins))
mlir.register_lowering(histogram_p, mlir.lower_fun(lambda values, *, num_bins: histogram_reference(values, num_bins),
                                                   multiple_results=False))


def _register_triton_lowering():
    """Pallas Triton lowering rule: one `tt.histogram` op. jax's Triton lowering module and jaxlib's Triton dialect
    bindings are private; if either moved, kernels using `histogram` fail to lower with this error (no fallback)."""
    try:
        from jax._src.lib.mlir import ir
        from jax._src.lib.triton import dialect as tt_dialect
        from jax._src.pallas.triton import lowering as triton_lowering
    except ImportError:  # pragma: no cover - jaxlib without Triton
        return

    def rule(ctx, values, *, num_bins):
        result_type = ir.RankedTensorType.get([num_bins], ir.IntegerType.get_signless(32))
        return tt_dialect.histogram(result_type, values)

    triton_lowering.triton_lowering_rules[histogram_p] = rule


_register_triton_lowering()
