#!/usr/bin/env bash
# Registers / spills of the compiled Pallas-Triton kernels (H200 diagnostic). jax 0.11.2 hands a Pallas-Triton
# kernel to XLA as Triton IR (no Python-side triton.compile to intercept: session 5 captured nothing that way), so
# this script compiles each kernel configuration in its own jitted function named after it, lets XLA dump the
# module's PTX (--xla_dump_to), and runs `ptxas -v` (sm_90a) on every dumped PTX module: one line per module with
# each entry's registers and spill bytes. Kernels: the decode sparse-attention kernel (B = 64; bf16 / FP8 pools,
# a few configs incl. col_splits), the indexer scores kernel + top-k kernels (bf16 / fp8 / fp4 keys).
#   device run:  OUT=$OUT bash benchmarks/kernel_resources.sh      (writes $OUT/kernel_resources.log)
set -o pipefail
OUT=${OUT:-/tmp/kres}; X=/tmp/kres_xla_dump; rm -rf "$X"; mkdir -p "$OUT" "$X"
export PYTHONPATH=.:tests XLA_PYTHON_CLIENT_PREALLOCATE=false
XLA_FLAGS="--xla_dump_to=$X --xla_gpu_autotune_level=0" timeout 250 python3 - <<'EOF' 2>&1 | grep -v -i warning | tail -20
import jax, jax.numpy as jnp
from test_sparse_attention import make_inputs
from pallas_kernels.sparse_attention import sparse_attention
from pallas_kernels.indexer import formats
from pallas_kernels.indexer.gpu import indexer_topk_gpu

KEYS = ("q", "window_kv", "window_idx", "compressed_kv", "compressed_idx", "sinks")
attn = [("bf16", False, {}), ("bf16_cs2", False, dict(col_splits=2)), ("bf16_cs2_ns1", False, dict(col_splits=2, n_splits=1)),
        ("bf16_dc64", False, dict(d_chunk=64)), ("fp8", True, {}), ("fp8_cs2", True, dict(col_splits=2)),
        ("fp8_f16", True, dict(fp8_operands="f16"))]
for v, fp8, opts in attn:
    inp = make_inputs(64, 1, 64, 512, 64 * 128, 64 * 600, 128, 512, fp8=fp8)
    lens = dict(window_len=inp["window_len"], compressed_len=inp["compressed_len"])
    fn = lambda *a, o=opts: sparse_attention(*a, scale=512 ** -0.5, impl="pallas", **lens, **o)
    fn.__name__ = fn.__qualname__ = "attn_" + v          # -> module jit_attn_<v> in the dump
    try:
        jax.block_until_ready(jax.jit(fn)(*(inp[k] for k in KEYS)))
        print("compiled", fn.__name__, flush=True)
    except Exception as e:  # noqa: BLE001
        print(v, "failed:", repr(e)[:300], flush=True)
B, T, H, dI = 64, 32768, 64, 128
for fmt, opts in (("bf16", {}), ("fp8", {}), ("fp4", {}), ("fp4", dict(precision="f16"))):
    keys = formats.quantize(jax.random.normal(jax.random.key(0), (B, T, dI)), fmt)
    q = formats.fake_quantize(jax.random.normal(jax.random.key(1), (B, 1, H, dI)), fmt)
    w = jax.random.normal(jax.random.key(2), (B, 1, H))
    fn = lambda q, w, k, n, o=opts: indexer_topk_gpu(q, w, k, n, k=512, **o)
    fn.__name__ = fn.__qualname__ = f"idx_{fmt}" + ("_f16" if opts else "")
    jax.block_until_ready(jax.jit(fn)(q, w, keys, jnp.full((B, 1), T, jnp.int32)))
    print("compiled", fn.__name__, flush=True)
EOF
PTXAS=$(command -v ptxas || ls /usr/local/cuda/bin/ptxas 2>/dev/null || find / -name ptxas -type f 2>/dev/null | head -1)
echo "ptxas: $PTXAS"
echo "xla dump: $(ls "$X" | wc -l) files; suffixes:"; ls "$X" | sed 's/.*\.//' | sort | uniq -c | sort -rn | head -8
{
for f in $(ls "$X" | grep -E "(attn|idx)_.*\.ptx$"); do
  arch=$(grep -m1 -o "sm_90a\|sm_90" "$X/$f"); arch=${arch:-sm_90a}
  # per entry: "<entry>: N registers, S bytes spill stores, L bytes spill loads" (only our Triton kernels' entries
  # carry the pallas_call names; XLA's own fusions in the same module are listed too, tersely)
  "$PTXAS" -arch=$arch -v "$X/$f" -o /dev/null 2>&1 | awk -v mod="$f" '
    /Compiling entry function/ { match($0, /'"'"'[^'"'"']+'"'"'/); fn = substr($0, RSTART + 1, RLENGTH - 2) }
    /bytes spill stores/ { spill = $0; sub(/.*ptxas info *: */, "", spill) }
    /Used [0-9]+ registers/ { match($0, /Used [0-9]+ registers/); print mod " | " fn " | " substr($0, RSTART, RLENGTH) " | " spill }'
done
} > "$OUT/kernel_resources.log" 2>&1
grep -E "sparse_attn|indexer|topk|exact|rank" "$OUT/kernel_resources.log" || head -40 "$OUT/kernel_resources.log"
echo "($(wc -l < "$OUT/kernel_resources.log") entries in $OUT/kernel_resources.log)"
rm -rf "$X"
