#!/usr/bin/env bash
# One call on the GPU machine (issue #5): compiled-kernel tests of the indexer and compressor kernels, then the
# benchmarks.   device run:  bash benchmarks/run_gpu_issue5.sh [--quick]
# Env: TEST_TIMEOUT (s, default 300), BENCH_TIMEOUT (s per benchmark, default 900), GPU_TEST_K (pytest -k filter).
# Writes $OUT/nvidia_smi.txt, gpu_tests.log, bench_indexer.log, bench_compressor.log, *_bench.json; summary last.
set -o pipefail
OUT=${OUT:-/tmp/issue5_out}; mkdir -p "$OUT"
export PYTHONPATH=.:tests PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv 2>&1 | tee "$OUT/nvidia_smi.txt"
python3 -c "import jax, jaxlib; print('jax', jax.__version__, jax.devices())" 2>&1 | tee -a "$OUT/nvidia_smi.txt"
timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -x -p no:cacheprovider tests/test_indexer_kernels.py \
  tests/test_compressor_kernels.py -k "${GPU_TEST_K:-gpu}" 2>&1 | tail -n 40 > "$OUT/gpu_tests.log"
echo "tests rc=$?" >> "$OUT/gpu_tests.log"
timeout ${BENCH_TIMEOUT:-900} python3 benchmarks/compressor.py --out "$OUT" "$@" > "$OUT/bench_compressor.log" 2>&1
echo "compressor bench rc=$?" >> "$OUT/bench_compressor.log"
timeout ${BENCH_TIMEOUT:-900} python3 benchmarks/indexer.py --out "$OUT" "$@" > "$OUT/bench_indexer.log" 2>&1
echo "indexer bench rc=$?" >> "$OUT/bench_indexer.log"
echo "== gpu tests"; tail -n 12 "$OUT/gpu_tests.log"
echo "== compressor"; grep -v "^\s*$" "$OUT/bench_compressor.log" | tail -n 14
echo "== indexer"; grep -v "^\s*$" "$OUT/bench_indexer.log" | tail -n 26
