#!/usr/bin/env bash
# One device call: kernel GPU tests, model-level pallas-vs-reference parity on the GPU, and the decode benchmark
# (reference vs pallas attention) for a 4-layer V4-Flash-shaped model (sliding, sliding, CSA, HCA), bf16, and the
# per-component breakdown of one decode step (benchmarks/decode_breakdown.py).
#   device run:  bash benchmarks/run_gpu_model.sh      (writes $OUT/*.log / *.txt, prints the tables last)
set -o pipefail
OUT=${OUT:-/tmp/model_out}; mkdir -p "$OUT"
export PYTHONPATH=.:tests PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv | tee "$OUT/nvidia_smi.txt"
timeout ${TEST_TIMEOUT:-400} python3 -m pytest -q -x -p no:cacheprovider tests/test_sparse_attention_gpu.py tests/test_model_pallas.py tests/test_model_pallas_quantized.py \
  2>&1 | tail -n 15 | tee "$OUT/gpu_model_tests.log"
for impl in reference pallas; do
  timeout ${DECODE_TIMEOUT:-150} python3 benchmarks/decode.py --preset v4-flash --layers 4 --experts 8 --dtype bfloat16 \
    --batch ${BATCH:-16} --contexts ${CONTEXTS:-4096,32768} --steps 32 --repeats 3 --attention-impl $impl \
    --out "$OUT/decode_${impl}.txt" 2>&1 | tail -n 12
done
timeout ${BREAKDOWN_TIMEOUT:-200} python3 benchmarks/decode_breakdown.py --preset v4-flash --layers 4 --experts 8 \
  --dtype bfloat16 --batch ${BATCH:-16} --context 32768 --attention-impl pallas --out "$OUT/decode_breakdown.txt" 2>&1 | tail -n 22
