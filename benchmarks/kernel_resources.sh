#!/usr/bin/env bash
# Registers / spills / shared memory of the compiled Pallas-Triton kernels (H200 diagnostic): compiles the decode
# sparse-attention kernel (bf16 and FP8 pools, B = 64), the indexer scores kernel (fp4 / fp8 / bf16 keys) and the
# top-k kernels with XLA's dump on, then runs `ptxas -v` for sm_90a over every dumped PTX module.
#   device run:  OUT=$OUT bash benchmarks/kernel_resources.sh      (writes $OUT/kernel_resources.log)
set -o pipefail
OUT=${OUT:-/tmp/kres}; D=$OUT/xla_dump; mkdir -p "$D"
export PYTHONPATH=.:tests XLA_PYTHON_CLIENT_PREALLOCATE=false
XLA_FLAGS="--xla_dump_to=$D" timeout 200 python3 - <<'EOF' 2>&1 | grep -v -i warning | tail -5
import jax, jax.numpy as jnp
from test_sparse_attention import make_inputs, call
from pallas_kernels.sparse_attention import sparse_attention
from pallas_kernels.indexer import formats
from pallas_kernels.indexer.gpu import indexer_topk_gpu
for fp8 in (False, True):
    inp = make_inputs(64, 1, 64, 512, 64 * 128, 64 * 600, 128, 512, fp8=fp8)
    jax.block_until_ready(call(sparse_attention, inp, impl="pallas"))
B, T, H, dI = 64, 32768, 64, 128
for fmt in ("bf16", "fp8", "fp4"):
    keys = formats.quantize(jax.random.normal(jax.random.key(0), (B, T, dI)), fmt)
    q = formats.fake_quantize(jax.random.normal(jax.random.key(1), (B, 1, H, dI)), fmt)
    w = jax.random.normal(jax.random.key(2), (B, 1, H))
    jax.block_until_ready(indexer_topk_gpu(q, w, keys, jnp.full((B, 1), T, jnp.int32), k=512))
print("compiled")
EOF
PTXAS=$(command -v ptxas || find / -name ptxas -type f 2>/dev/null | head -1)
echo "ptxas: $PTXAS"; ls "$D" | wc -l
{
for f in "$D"/*.ptx; do
  [ -f "$f" ] || continue
  grep -q -E "sparse_attn|indexer|topk|compress" "$f" || continue
  echo "== $(basename "$f")"
  "$PTXAS" -arch=sm_90a -v "$f" -o /dev/null 2>&1 | grep -E "Compiling entry|registers|spill" \
    | grep -B1 -A1 -E "sparse_attn|indexer|topk|compress|spill" | head -40
done
} > "$OUT/kernel_resources.log" 2>&1
cat "$OUT/kernel_resources.log" | head -120
