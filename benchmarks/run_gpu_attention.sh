#!/usr/bin/env bash
# One call on the GPU machine: GPU correctness tests of the sparse attention kernel, then the benchmark sweep.
#   device run:  bash benchmarks/run_gpu_attention.sh [--sweep] [--quick]
# Writes $OUT/gpu_tests.log, $OUT/bench.log, $OUT/sparse_attention_bench.json; prints the summary table last.
set -o pipefail
OUT=${OUT:-/tmp/sa_out}; mkdir -p "$OUT"
export PYTHONPATH=.:tests PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/nvidia_smi.txt"
timeout 240 python3 -m pytest -q -x tests/test_sparse_attention_gpu.py ${GPU_TEST_K:+-k "$GPU_TEST_K"} 2>&1 | tail -n 30 | tee "$OUT/gpu_tests.log"
timeout ${BENCH_TIMEOUT:-3000} python3 benchmarks/sparse_attention.py --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log" | grep -v "^\s*$" | tail -n 60
