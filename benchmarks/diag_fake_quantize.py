"""Does q's fake quantization survive XLA's GPU compiler? (session 21; the cause of the fp8-indexer model test's
failures on the H200 in sessions 20-21)

For each indexer key format: a jitted u -> dequantize(quantize(2u)) / 2 (the quantization inside a fusion), without
and with the optimization barrier `formats.fake_quantize` now puts on the storage, against the same on the CPU.
XLA's GPU compiler removes an f32 -> narrower float -> f32 round trip under --xla_allow_excess_precision (on by
default); without the barrier the quantization then vanishes.

    PYTHONPATH=. python benchmarks/diag_fake_quantize.py
"""
import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.indexer import formats as F

u = np.random.default_rng(11).standard_normal((16, 16, 128)).astype(np.float32)
cpu = jax.devices("cpu")[0]
print("backend", jax.default_backend())
for fmt in ("bf16", "fp8", "fp4"):
    with jax.default_device(cpu):
        expected = np.asarray(F.fake_quantize(jax.device_put(jnp.asarray(u), cpu), fmt))
    for name, fq in (("no barrier", lambda x: F.dequantize(F.quantize(x, fmt), jnp.float32)),
                     ("fake_quantize (barrier)", lambda x: F.fake_quantize(x, fmt))):
        out = np.asarray(jax.jit(lambda x: fq(x * 2.0) * 0.5)(jnp.asarray(u)))
        print(f"{fmt:4s} {name:24s}: {np.count_nonzero(out != expected):6d} of {u.size} values differ from the CPU's "
              f"(max {np.abs(out - expected).max():.3g}); {np.count_nonzero(out == u):6d} equal the unquantized input")
