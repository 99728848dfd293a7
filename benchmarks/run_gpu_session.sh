#!/usr/bin/env bash
# One device call that runs several steps, each under its own time limit, so one slow step cannot eat the call.
#   device run:  STEPS="tests5 model comp idx" bash benchmarks/run_gpu_session.sh [--quick]
# Steps: tests4 (sparse-attention GPU tests), tests5 (indexer + compressor + top-k GPU tests), model (model-level
# pallas-vs-reference parity on the GPU), comp / idx / attn (benchmarks/compressor.py, indexer.py,
# sparse_attention.py; diag = benchmarks/diag_indexer_prefill.py; topk / topk_cb = benchmarks/topk_stages.py (topk_cb with
# XLA command buffers incl. conditionals, CB_TYPES); kres = benchmarks/kernel_resources.sh (ptxas registers/spills); compv = compressor kernel variants on COMPV_CASES), decode (benchmarks/decode.py ref vs pallas), picks (decode.py, Pallas, indexer picks sorted vs set), gather (benchmarks/tma_row_gather_{raw,probe}.py: row-gather producer bandwidth), mosaic (benchmarks/mosaic_attention.py: Mosaic vs Triton attention; MOSAIC_ARGS='--cases prefill|splits'), breakdown (benchmarks/decode_breakdown.py; BREAKDOWN_ARGS, e.g. '--parts --kernels --indexer-dtype fp8'), mres (benchmarks/mosaic_resources.py: ptxas registers / spills of the Mosaic attention kernel's variants), fp4res (benchmarks/indexer_fp4_resources.py: registers and spills of the Mosaic indexer kernel over fp4 keys per precision), ss (benchmarks/mosaic_split_scores.py: split_scores checked per variant in its own process, then timed), ssdiag (benchmarks/diag_split_scores_model.py: the tiny model's attention calls, default vs split_scores vs the reference op, per call), mprof (benchmarks/mosaic_phase_profile.py: the Mosaic attention kernel's per-warpgroup phases from Mosaic GPU's on-device profiler; MPROF_ARGS='--cases ...'), iprof (benchmarks/indexer_phase_profile.py: the same for the Mosaic indexer kernel's scorer and fp4 converter, a key block at a time; IPROF_ARGS='--cases ...'), dk (benchmarks/decode_kernels.py: the kernels one decode call launches, CUPTI durations vs wall; DK_ARGS), mdiag (benchmarks/diag_indexer_mosaic_model.py: the Mosaic indexer kernel on the failing model test's captured decode inputs of both model paths, row by row, saved to mdiag_captures.npz), fq (benchmarks/diag_fake_quantize.py + the jitted fake-quantization tests: does q's quantization survive XLA's GPU compiler), ikern (benchmarks/indexer_kernels.py: the kernels one indexer call launches, CUPTI durations vs the net time per call; IKERN_ARGS), mops (benchmarks/diag_model_ops.py: every kernel call of the fp8-indexer model test against its reference op on the same inputs; MOPS_ARGS), msmall (benchmarks/diag_indexer_mosaic_small_t.py: the kernel alone at the model test's shape), dk_nocb / dk_cb (the same with XLA's command buffers off / on for CB_TYPES incl. custom calls, graphs from 1 thunk), moe (benchmarks/moe_layout.py: the routed experts' grouped matmuls with the weights [E, out, in] as stored vs [E, in, out] vs the grouped-matmul kernel, kernels and optimized HLO; MOE_ARGS, e.g. '--experts 256 --batches 1,16,64'), gmm (tests/test_grouped_matmul.py: the grouped-matmul kernel compiled against the reference; GMM_K), gmmdecode (benchmarks/decode.py, the whole decode step with the routed experts on XLA's ragged dot vs the grouped-matmul kernel, V4-Flash's 256 experts; GMM_IMPLS, GMM_EXPERTS, LAYERS, GMMDECODE_ARGS; GMM_WEIGHTS='dequantized fp4': one run per expert-weight format; FP4_CONFIGS='decode=join decode=join_t,num_warps=2,block_n=64': one run per FP4-weight kernel config).
# PYTEST_N=<workers>: the test steps run in that many pytest-xdist processes sharing the GPU (compiling dominates the
# tests, and the device machine has 16 cores): e.g. PYTEST_N=3 STEPS=tests5. With 8 and 3 workers tests5 ran out of
# GPU memory on an H100 (session 62, results/h100_s62r{2,3}_tests5.log: `make`'s 10-12 GB f32 keys of the 640-768-row
# cases beside other workers); those cases now draw their keys on the device (test_indexer_segment_select.make_decode),
# and with 3 workers (session 63, h100_s63r1_tests5.log) 60 of 62 passed, 2 ran out of memory in check_picks' reference
# (9-18 GiB in one piece), which now runs 128 rows at a time.
# XLA_FLAGS set by the caller reach every step (the tests add --xla_gpu_autotune_level=0 to them), e.g.
#   XLA_FLAGS=--xla_gpu_enable_pdl=true STEPS="dk tests4" ... (programmatic dependent launch, untried as of session 16)
# FAULT_T: seconds before a test's Python stack is dumped (default 100; 600 for the model step, whose tests compile
# for 130-145 s each on the H200: session 52's dump fired inside one and the process died of SIGSEGV, rc 139).
# Per-step limit: T_<step> seconds (defaults below). A test that hangs dumps its Python stack (faulthandler) into
# the step's log. Logs: $OUT/<step>.log (+ the benchmarks' json).
set -o pipefail
OUT=${OUT:-/tmp/session_out}; mkdir -p "$OUT"
# DSV4_INSTANT_FAILURES: tests/conftest.py prints a failing test's report at once (a step's limit can cut pytest's
# closing summary)
export PYTHONPATH=.:tests PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false DSV4_INSTANT_FAILURES=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv > "$OUT/env.log" 2>&1
python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())" >> "$OUT/env.log" 2>&1
cat "$OUT/env.log"
# tests: XLA's GEMM autotuning off (compile time, not kernel speed, dominates the tiny test models); -rf lists
# failures at the end, --tb=short keeps them readable
PYT=(bash -c 'XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_gpu_autotune_level=0" exec python3 -m pytest -v -rfP \
  --tb=short -p no:cacheprovider -o faulthandler_timeout=${FAULT_T:-100} --durations=8 ${PYTEST_N:+-n $PYTEST_N} "$@"' pytest)
PY="python3 -X faulthandler"
run_step() {  # name, default limit, command...
  local name=$1 lim=$2; shift 2
  local var="T_$name"; lim=${!var:-$lim}
  local t0=$(date +%s)
  timeout -k 5 "$lim" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "[$name] rc=$rc in $(( $(date +%s) - t0 )) s (limit $lim)" | tee -a "$OUT/$name.log"
  grep -v '^\s*$' "$OUT/$name.log" | grep -v -i warning | tail -n ${TAIL:-25}
}
for s in ${STEPS:-tests5 model comp idx}; do
  case $s in
    tests4) run_step tests4 200 "${PYT[@]}" tests/test_sparse_attention_gpu.py ${T4_K:+-k "$T4_K"} ;;
    tests5) run_step tests5 450 "${PYT[@]}" tests/test_indexer_kernels.py tests/test_compressor_kernels.py \
          tests/test_indexer_topk.py tests/test_indexer_segment_select.py tests/test_indexer_q_prep.py \
          -k "${GPU_TEST_K:-gpu or matches_lax or edge_values}" ;;
    model) FAULT_T=${FAULT_T:-600} run_step model 340 "${PYT[@]}" tests/test_model_pallas.py tests/test_model_pallas_quantized.py ${MODEL_K:+-k "$MODEL_K"} ;;
    comp) run_step comp 120 $PY benchmarks/compressor.py --out "$OUT" "$@" ${COMP_ARGS:-} ;;
    compv) run_step compv 120 $PY benchmarks/compressor.py --out "$OUT/variants" --variants --cases ${COMPV_CASES:-prefill} ${COMPV_ARGS:-} ;;
    idx) run_step idx 180 $PY benchmarks/indexer.py --out "$OUT" "$@" ${IDX_ARGS:-} ;;
    ikern) run_step ikern 200 $PY benchmarks/indexer_kernels.py --out "$OUT" ${IKERN_ARGS:-} ;;
    topk) run_step topk 120 $PY benchmarks/topk_stages.py --out "$OUT" ${TOPK_ARGS:-} ;;
    topk_cb) XLA_FLAGS="--xla_gpu_enable_command_buffer=${CB_TYPES:-FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE}" \
          run_step topk_cb 120 $PY benchmarks/topk_stages.py --out "$OUT/cb" ${TOPK_ARGS:-} ;;
    kres) run_step kres 200 bash benchmarks/kernel_resources.sh ;;
    diag) run_step diag 120 $PY benchmarks/diag_indexer_prefill.py ${DIAG_ARGS:-} ;;
    mdiag) run_step mdiag 200 $PY benchmarks/diag_indexer_mosaic_model.py --save "$OUT/mdiag_captures.npz" ${MDIAG_ARGS:-} ;;
    fq) run_step fq 120 bash -c "$PY benchmarks/diag_fake_quantize.py && python3 -m pytest -q -p no:cacheprovider tests/test_indexer_formats.py -k jitted" ;;
    mops) run_step mops 200 $PY benchmarks/diag_model_ops.py ${MOPS_ARGS:-} ;;
    msmall) run_step msmall 90 $PY benchmarks/diag_indexer_mosaic_small_t.py ;;
    mosaic) run_step mosaic 300 $PY benchmarks/mosaic_attention.py --out "$OUT" ${MOSAIC_ARGS:-} ;;
    fp4res) mkdir -p /tmp/fp4_dump && MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=/tmp/fp4_dump \
          run_step fp4res 150 $PY benchmarks/indexer_fp4_resources.py /tmp/fp4_dump ;;
    mres) mkdir -p "$OUT/mgpu_dump" && MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO="$OUT/mgpu_dump" \
          run_step mres 150 $PY benchmarks/mosaic_resources.py "$OUT/mgpu_dump" ${MRES_NAMES:-} ;;
    gather) run_step gather 300 bash -c "$PY benchmarks/tma_row_gather_raw.py $OUT/tma_row_gather_raw.json && \
          $PY benchmarks/tma_row_gather_probe.py $OUT/tma_row_gather_pallas.json" ;;
    ss) run_step ss 220 $PY benchmarks/mosaic_split_scores.py --out "$OUT" ${SS_ARGS:-} ;;
    ssdiag) run_step ssdiag 240 $PY benchmarks/diag_split_scores_model.py ;;
    dk) run_step dk 200 $PY benchmarks/decode_kernels.py --out "$OUT" ${DK_ARGS:-} ;;
    dk_nocb) XLA_FLAGS="--xla_gpu_enable_command_buffer=" \
          run_step dk_nocb 200 $PY benchmarks/decode_kernels.py --out "$OUT" --name decode_kernels_nocb ${DK_ARGS:-} ;;
    dk_cb) XLA_FLAGS="--xla_gpu_enable_command_buffer=${CB_TYPES:-FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN} --xla_gpu_graph_min_graph_size=1" \
          run_step dk_cb 200 $PY benchmarks/decode_kernels.py --out "$OUT" --name decode_kernels_cb ${DK_ARGS:-} ;;
    moe) run_step moe 150 $PY benchmarks/moe_layout.py --hlo "$OUT/moe_hlo" --out "$OUT/moe_layout.json" ${MOE_ARGS:-} ;;
    gmm) run_step gmm 200 "${PYT[@]}" tests/test_grouped_matmul.py tests/test_grouped_matmul_fp4.py ${GMM_K:+-k "$GMM_K"} ;;
    gmmdecode) for g in ${GMM_IMPLS:-reference pallas}; do for w in ${GMM_WEIGHTS:-default}; do for d in ${FP4_CONFIGS:-default}; do
        tag=$g${GMM_WEIGHTS:+_$w}${FP4_CONFIGS:+_${d//[=,]/_}}   # each GEMM impl (x expert weights x FP4 kernel config)
        run_step gmmdecode_$tag 150 $PY benchmarks/decode.py --preset v4-flash --layers ${LAYERS:-4} \
          --experts ${GMM_EXPERTS:-256} --dtype bfloat16 --batch ${BATCH:-16} --contexts ${CONTEXTS:-32768} \
          --steps 16 --repeats 3 --attention-impl pallas --experts-gmm $g ${GMM_WEIGHTS:+--expert-weights $w} \
          ${FP4_CONFIGS:+--fp4-config $d} ${GMMDECODE_ARGS:-} --out "$OUT/gmmdecode_$tag.txt"; done; done; done ;;
    mprof) run_step mprof 240 $PY benchmarks/mosaic_phase_profile.py --out "$OUT" ${MPROF_ARGS:-} ;;
    iprof) run_step iprof 300 $PY benchmarks/indexer_phase_profile.py --out "$OUT" ${IPROF_ARGS:-} ;;
    attn) run_step attn 300 $PY benchmarks/sparse_attention.py --out "$OUT" "$@" ${ATTN_ARGS:---net-decode} ;;  # net: the issue tables
    decode) for impl in ${DECODE_IMPLS:-reference pallas}; do
        run_step decode_$impl 150 $PY benchmarks/decode.py --preset v4-flash --layers 4 --experts 8 \
          --dtype bfloat16 --batch ${BATCH:-16} --contexts ${CONTEXTS:-4096,32768} --steps 32 --repeats 3 \
          --attention-impl $impl --out "$OUT/decode_$impl.txt"; done ;;
    picks) for picks in sorted set; do  # the whole decode step, Pallas path, each order of the indexer's picks
        run_step picks_$picks 150 $PY benchmarks/decode.py --preset v4-flash --layers 4 --experts 8 \
          --dtype bfloat16 --batch ${BATCH:-16} --contexts ${CONTEXTS:-4096,32768} --steps 32 --repeats 3 \
          --attention-impl pallas --indexer-picks $picks --out "$OUT/picks_$picks.txt"; done ;;
    breakdown) run_step breakdown 200 $PY benchmarks/decode_breakdown.py --preset v4-flash --layers 4 \
          --experts 8 --dtype bfloat16 --batch ${BATCH:-16} --context 32768 --attention-impl pallas \
          ${BREAKDOWN_ARGS:-} --out "$OUT/decode_breakdown.txt" ;;
    *) echo "unknown step $s" ;;
  esac
done
