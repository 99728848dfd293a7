"""Which implementation of an op runs where — one rule for every dispatcher in pallas_kernels."""

from __future__ import annotations

import os

import jax

IMPLS = ("auto", "pallas", "reference")
_ACCELERATORS = ("gpu", "cuda", "rocm", "tpu")
PLATFORMS = ("cpu",) + _ACCELERATORS


def kernel_platform() -> str:
    """The platform the dispatchers choose kernels for: $DSV4_KERNEL_PLATFORM where set (one of `PLATFORMS`), for
    ahead-of-time compiles for a device this host does not have (e.g. libtpu compiling for a TPU topology on a CPU
    host: `benchmarks/tpu_offline.py`), else jax's default backend."""
    forced = os.environ.get("DSV4_KERNEL_PLATFORM")
    if forced is None:
        return jax.default_backend()
    if forced not in PLATFORMS:
        raise ValueError(f"DSV4_KERNEL_PLATFORM must be one of {PLATFORMS}, got {forced!r}")
    return forced


def resolve_impl(impl: str, op: str, extra: tuple = ()) -> str:
    """'auto' | 'pallas' | 'reference' (| extra, e.g. 'interpret_tpu' for tests) -> 'reference' | 'gpu' | 'tpu' |
    'interpret' | an extra name. auto = the Pallas kernel on GPU/TPU, the reference on CPU; 'pallas' on CPU runs the
    GPU kernel in the Pallas interpreter (slow; for tests)."""
    if impl not in IMPLS + tuple(extra):
        raise ValueError(f"{op} impl must be one of {IMPLS}, got {impl!r}")
    if impl in extra:
        return impl
    plat = kernel_platform()
    if impl == "reference" or (impl == "auto" and plat not in _ACCELERATORS):
        return "reference"
    if plat in ("gpu", "cuda"):
        return "gpu"
    if plat == "tpu":
        return "tpu"
    return "interpret"


def run_resolved(where: str, impl: str, op: str, kernel_options: dict, *, applies, reference, gpu, tpu):
    """Runs an op where `resolve_impl` sent it (`where`, with 'interpret_tpu' among its extras): impl 'auto' falls
    back to the reference where `applies(where)` says that kernel does not take the shapes (a custom small config);
    kernel options are refused on the reference; `reference()`, `gpu(interpret=..., **kernel_options)` for 'gpu' /
    'interpret', `tpu(interpret=..., **kernel_options)` for 'tpu' / 'interpret_tpu'."""
    if impl == "auto" and where in ("gpu", "tpu") and not applies(where):
        where = "reference"
    if where == "reference":
        if kernel_options:
            raise ValueError(f"{op}: kernel options {sorted(kernel_options)} apply to the kernels only "
                             f"(impl={impl!r} runs the reference here)")
        return reference()
    if where in ("tpu", "interpret_tpu"):
        return tpu(interpret=where == "interpret_tpu", **kernel_options)
    return gpu(interpret=where == "interpret", **kernel_options)
