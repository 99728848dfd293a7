#!/usr/bin/env bash
# The device work still pending, as one command that picks its steps by the card it lands on (the device tool gives
# an H100 or an H200, whichever comes; H200s have not come since session 55). Each part fits one 600 s call.
#   device run:  PART=1 bash benchmarks/run_gpu_pending.sh        (then PART=2, 3, 4, 5 while the machine is warm)
# Still pending (sessions 75-76): HIST=1, then HIST=1 HIST_TIMING=1, on any card (two calls: timing twice, the GPU
# tests, the model test); an H200's PART=1 (none has come since session 55; the H100 ran both tables in session 73).
# H200, part 1 / any other card, part 1: issue #4's decode table on today's defaults (consumers="asym" for bf16 since
#   session 66, for FP8 over the converter's tiles since session 68) with the XLA reference at B = 64; on an H200
#   then issue #5's rows (indexer decode at 8K / 128K / 1M, B = 1 and 64, each key format) on the defaults, against
#   session 54's q preparation grid of before (`mosaic.q_prep_heads=64`) in the same call.
# H200, parts 2-3: consumers="asym" (FlashMLA's consumer split) on the H200, so far measured on an H100 only (session
#   65): its GPU tests (the kernel against the reference: bf16 rings and FP8's direct gather) and its bf16 timing
#   against the pair (group s64: decode rows and prefill); then its FP8 timing (group s64f: the direct gather with
#   the asym split against the converter default and the direct gather with the pair), the FP8 converter's
#   conversions (group s67: "cvt", its default since session 67, against "rebias" and bits) and the phase profile.
# H200, part 4 / any other card, part 3: consumers="asym" over the FP8 converter warpgroup's 32-row tiles (the FP8
#   default since session 68, measured on an H100 only): its GPU tests (T4_K "cvwg and asym"), its timing against
#   the pair (group s67a) and the phase profile of both.
# H200, part 5 / any other card, part 2: under FP8's asym the converter sets the pace (session 68's profile), so the
#   producer takes 1 or 2 of its 9 passes (group s68: conv_units 8 / 7, two register splits, against the default),
#   next to the bound without conversions (_diag="no_convert", wrong output), and the phase profile of both.
# Any other card: parts 4-5 as the H200's parts 2-3 (done on an H100 in session 65).
# INDEXER_TESTS=1 (any card, any part): the indexer GPU tests of sessions 62-63 instead (all passed on an H100 in
#   session 63).
# T_ASYM_TESTS / T_ASYM_TIMING / ASYM_GROUP (s64q: the short form) / T_S64F / T_S67 for a call with little device
#   time left (T_CONV_ASYM_TESTS / T_CONV_ASYM_TIMING for conv_asym).
# FP8_CHECK=1 (any card): the FP8-cache model test and all FP8 kernel cases side by side (~210 s), the check an FP8
#   default change needs (session 68).
# F16=1 (any card; done in session 71 with COPY=1 and FP8_CHECK=1, both now defaults): fp8_operands="f16" and
#   fp8_chunk_order="owned" (session 69: their GPU cases passed on an H100, h100_s69r1): their GPU tests, their timing (group s69),
#   the phase profiles, then the FP8-cache model test on both as a trial default (~560 s in all; the model test
#   last, as it matters only if they win).
# COPY=1 (any card; run in session 71, h100_s71r1, and the five made the FP8 defaults: the group's "defaults" column
#   names session 70's): session 70's three options over FP8's asym: fp8_copy
#   (the producer's FP8 staging copies as 1-D bulk copies), asym_scorer_cols=128 (a
#   quarter of P.V moved from the scorer to the helper) and asym_q_regs (q's first columns in the scorer's
#   registers): their GPU tests, group s70 (against the defaults, with bf16 operands and with f16 + owned), the
#   phase profiles; then, unless NO_F16_MODEL is set, the FP8-cache model test on f16 + owned as a trial default
#   (F16=1's last step).
# S71=1 (any card): session 71's FP8 defaults (f16 operands, owned order, bulk copies, asym_scorer_cols 128,
#   asym_q_regs 256): the FP8 kernel cases that name a caller option the defaults had to yield to (rebias, a 3-entry
#   regs) and the one the FP8 check's time limit cut, then issue #4's FP8 decode table with the XLA reference at
#   B = 64 (~250 s in all; the bf16 defaults did not change).
# S72=1 (any card): S71's 43 recheck cases and the 8 GPU cases of a third tile slot on the FP8 defaults at the
#   converter's 64 registers, group s72 (that slot at two register splits against the defaults), then the FP8 decode
#   table with the XLA reference at B = 64 (~550 s in all; run on an H100 in session 73, h100_s73r1: 280 s, all cases
#   passed, the third slot set aside). IDX_TABLE=1: issue #5's indexer rows alone (PART=1's
#   second step on an H200, ~170 s).
# CONV_SYNC=1 (any card; session 74; run in session 75, h100_s75r1: all passed, no faster): conv_sync "arrive": its
#   fp4 converter GPU cases, its timing against the default and "early", its phase profile, the fp4-key model test
#   with it as the default (~300 s; NO_MODEL=1: ~140 s).
# HIST=1 (any card; sessions 75-76): seg_hist "converter" and conv_sync "early", together, and with them
#   select_wgs 2 (session 76: the converter warpgroup joins the selection); q_prep "fused" (session 76: the scorer
#   makes its row's q operand, no Triton q kernel) alone and with all three: timing against the defaults, phase
#   profiles, then all four as the defaults in the device copy: the fp4 converter / segment top-k GPU tests (their
#   own cases compare each option against the code before; ~490 s). Then HIST=1 HIST_TIMING=1 for the second call:
#   the timing again and the fp4-key model test with all four as the defaults (~460 s; NO_MODEL=1: the timing
#   alone). Where they pass and win in both calls, make them the defaults.
# SEG_SYNC=1 (any card; session 74): seg_sync "barrier" (the new default): its fp4 GPU tests, its timing against
#   "commit" on the fp4 rows, its phase profile, the fp4-key model test (~550 s).
# IDX_PROF=1 (any card; session 74): the Mosaic indexer kernel's phase profile (fp4 at B = 64 x 128K with and without
#   the selection, one e5m2 slot, B = 16; fp8 at 1 CTA an SM), then issue #5's indexer rows (~60 s on an H100).
# PART=0 (any card): the model-level Mosaic tests, the bf16 one per forced consumer schedule (asym, the pair,
#   split_scores) and the FP8-cache one, four processes at once (all four passed on an H100 in session 66 in 307 s,
#   which made asym the bf16 default).
# Logs: $OUT/<part>/<step>.log, as benchmarks/run_gpu_session.sh writes them.
set -o pipefail
OUT=${OUT:-/tmp/pending_out}
card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>&1 | head -n 1)
echo "card: $card; part ${PART:-1}"   # (the device copy's git history can be stale: no commit here)
session() { OUT="$OUT/$1" bash benchmarks/run_gpu_session.sh; }
indexer_tests() {
  T_tests5=150 STEPS=tests5 GPU_TEST_K="gpu and past_1024" session tests_past_1024
  PYTEST_N=3 T_tests5=${T_SEGMENT:-380} STEPS=tests5 GPU_TEST_K="gpu and (segment_set_picks or past_one_wave)" \
    session tests_segment
}
asym() {
  PYTEST_N=4 T_tests4=${T_ASYM_TESTS:-170} T4_K="asym" STEPS=tests4 session asym_tests
  T_attn=${T_ASYM_TIMING:-260} ATTN_ARGS="--groups ${ASYM_GROUP:-s64} --net-decode --no-ref" STEPS=attn \
    session asym_timing
}
decode_table() {
  T_attn=290 ATTN_ARGS="--groups decode --net-decode --ref-batches 64" STEPS=attn session decode_table
}
indexer_table() {   # issue #5's rows: indexer decode at 8K / 128K / 1M, B = 1 and 64, each key format, on the defaults
  # against session 54's q preparation grid (mosaic.q_prep_heads=64) in the same call
  T_idx=${T_IDX:-170} STEPS=idx IDX_ARGS="--skip-topk-only --variants pallas_auto_set \
--set-configs topk=auto_set,mosaic.q_prep_heads=64 --cases 64x1x131072xfp4,64x1x131072xfp8,64x1x131072xbf16,1x1x131072xfp4,1x1x131072xfp8,64x1x1048576xfp4,\
64x1x1048576xfp8,1x1x1048576xfp4,64x1x8192xfp8" session indexer_table
}
asym_fp8_and_profile() {
  T_attn=${T_S64F:-170} ATTN_ARGS="--groups s64f --net-decode --no-ref" STEPS=attn session asym_fp8_timing
  # the converter's conversion, "cvt" (the default since session 67, measured on an H100) against "rebias" and bits
  T_attn=${T_S67:-120} ATTN_ARGS="--groups s67 --net-decode --no-ref" STEPS=attn session converter_conversions
  T_mprof=200 MPROF_ARGS="--cases csa128_asym,csa128_nosd,prefill2k_asym,csa128_fp8_direct_asym,csa128_fp8_direct" STEPS=mprof session asym_profile
}
conv_asym() {   # consumers="asym" over the FP8 converter's 32-row tiles (the FP8 default since session 68):
  # its GPU tests, then its timing against the pair (group s67a) and its phase profile next to the pair's
  PYTEST_N=4 T_tests4=${T_CONV_ASYM_TESTS:-150} T4_K="cvwg and asym" STEPS=tests4 session conv_asym_tests
  T_attn=${T_CONV_ASYM_TIMING:-150} ATTN_ARGS="--groups s67a --net-decode --no-ref" STEPS=attn session conv_asym_timing
  T_mprof=150 MPROF_ARGS="--cases csa128_fp8_cv_pair,csa128_fp8_cv_asym" STEPS=mprof session conv_asym_profile
}
asym_conv_units() {   # group s68 (session 68): conv_units 8 / 7 under FP8's asym against the default, and the bound
  # without conversions (_diag="no_convert"), then the phase profile of the default next to that bound
  T_attn=${T_S68:-260} ATTN_ARGS="--groups s68 --net-decode --no-ref" STEPS=attn session asym_conv_units
  T_mprof=120 MPROF_ARGS="--cases csa128_fp8_cv_asym,csa128_fp8_asym_noconv" STEPS=mprof session asym_noconv_profile
}
f16_operands() {   # session 69: fp8_operands="f16" and fp8_chunk_order="owned" over the converter's tiles under asym:
  # their GPU kernel tests (every "_f16" / "_owned" Mosaic case and the loud failure past f16's range), group s69
  # (against bf16 operands and the diagonal order, the no-conversion bound, f16 without q's conversion, f16 with
  # conv_batch=2), the phase profiles, then the FP8-cache model test with f16 + owned as a trial default (set in this
  # copy of the tree for that test)
  PYTEST_N=4 T_tests4=${T_F16_TESTS:-160} T4_K="(f16 or owned) and mosaic" STEPS=tests4 session f16_tests
  T_attn=${T_S69:-220} ATTN_ARGS="--groups s69 --net-decode --no-ref" STEPS=attn session f16_timing
  T_mprof=100 MPROF_ARGS="--cases csa128_fp8_cv_asym,csa128_fp8_asym_f16,csa128_fp8_asym_f16_owned,\
csa128_fp8_asym_noconv" STEPS=mprof session f16_profile
  f16_model
}
fp8_copy() {   # session 70: fp8_copy="bulk", asym_scorer_cols=128, asym_q_regs=256 against the defaults
  PYTEST_N=${PYTEST_N:-2} T_tests4=${T_COPY_TESTS:-200} T4_K="(copy or sc128 or qr) and mosaic" STEPS=tests4 session copy_tests
  T_attn=${T_S70:-230} ATTN_ARGS="--groups s70 --net-decode --no-ref" STEPS=attn session copy_timing
  T_mprof=130 MPROF_ARGS="--cases csa128_fp8_cv_asym,csa128_fp8_asym_sc128,csa128_fp8_asym_sc128_qr256,\
csa128_fp8_asym_all70" STEPS=mprof session copy_profile
  if [ -z "$NO_F16_MODEL" ]; then f16_model; fi
}
f16_model() {   # the FP8-cache model test with f16 + owned set as a trial default in this copy of the tree
  local mod=pallas_kernels/sparse_attention/gpu_mosaic.py
  sed -i -e 's/^DEFAULT_FP8_OPERANDS = "bf16"/DEFAULT_FP8_OPERANDS = "f16"/' \
    -e 's/"converter": "diagonal", "direct"/"converter": "owned", "direct"/' $mod
  grep -n '^DEFAULT_FP8_OPERANDS\|^DEFAULT_FP8_CHUNK_ORDER' $mod
  PYTEST_N=1 T_model=${T_MODEL:-300} MODEL_K=fp8_cache_bf16_model_on_mosaic STEPS=model session f16_model
}
model_asym() {   # the bf16 model test, one test per consumer schedule forced (asym, pair, split_scores; session 66),
  # next to the FP8-cache model test, four processes at once (one test took 170-347 s in sessions 45-60 with one
  # Mosaic leg fewer and was cut at 170 and 205 s in session 65; a leg compiles the model three times, ~60-70 s each)
  PYTEST_N=${PYTEST_N:-4} T_model=${T_MODEL:-420} MODEL_K=${MODEL_K:-bf16_model_on_mosaic} STEPS=model \
    session model_asym
}
fp8_default_check() {   # the FP8-cache model test next to every FP8 kernel case (session 68's check of an FP8 default,
  # h100_s68r4: 199 s and 164 s side by side); waits on the model step's pid (a `pgrep -f` would find this shell)
  PYTEST_N=1 T_model=${T_MODEL:-340} MODEL_K=fp8_cache_bf16_model_on_mosaic STEPS=model session fp8_model &
  local model_pid=$!
  sleep 15   # (the model test's first compile ahead of the kernel cases' four processes)
  PYTEST_N=4 T_tests4=${T_FP8_TESTS:-280} T4_K=fp8 STEPS=tests4 session fp8_kernel_cases
  wait "$model_pid"
}
if [ -n "$INDEXER_TESTS" ]; then indexer_tests; exit; fi
if [ -n "$FP8_CHECK" ]; then fp8_default_check; exit; fi
if [ -n "$F16" ]; then f16_operands; exit; fi
if [ -n "$COPY" ]; then fp8_copy; exit; fi
# session 71's recheck (its defaults yielding to a caller's rebias / 3-entry regs, the case the FP8 check's limit cut,
# the bulk copies' cases) and issue #4's FP8 decode table with the XLA reference at B = 64
S71_K="rebias or cb2 or dequantize_f32 or copybulk"
fp8_table() {
  T_attn=${T_S71_TABLE:-200} ATTN_ARGS="--groups decode --dtypes fp8 --net-decode --ref-batches 64" STEPS=attn \
    session s71_fp8_table
}
if [ -n "$S71" ]; then
  PYTEST_N=4 T_tests4=${T_S71_TESTS:-110} T4_K="fp8 and ($S71_K)" STEPS=tests4 session s71_recheck
  fp8_table; exit
fi
if [ -n "$S72" ]; then   # session 72: S71's recheck and the third tile slot's GPU cases, group s72, the FP8 table
  PYTEST_N=4 T_tests4=${T_S72_TESTS:-150} T4_K="fp8 and ($S71_K or (st2_ts3 and (_r40 or _r32)))" STEPS=tests4 \
    session s72_tests
  T_attn=${T_S72_TIMING:-200} ATTN_ARGS="--groups s72 --net-decode --no-ref" STEPS=attn session s72_timing
  if [ -n "$S72_SHORT" ]; then exit; fi   # (a call with little device time left: the table next time)
  fp8_table; exit
fi
fp4_option() {   # session 74: an fp4 converter option against the defaults: $1 the steps' name prefix, $2 its GPU
  # tests (GPU_TEST_K), $3 the indexer configs beside the default (--set-configs), $4 the indexer cases, $5 the phase
  # profile's cases; then, unless NO_MODEL is set, the fp4-key model test (on the defaults of this copy of the tree)
  PYTEST_N=4 T_tests5=${T_OPT_TESTS:-200} STEPS=tests5 GPU_TEST_K="$2" session "$1_tests"
  T_idx=${T_OPT_IDX:-130} STEPS=idx IDX_ARGS="--skip-topk-only --variants pallas_auto_set --set-configs $3 --cases $4" \
    session "$1_timing"
  T_iprof=${T_OPT_PROF:-100} IPROF_ARGS="--cases $5" STEPS=iprof session "$1_profile"
  if [ -z "$NO_MODEL" ]; then fp4_model "$1_model"; fi
}
fp4_model() { PYTEST_N=1 T_model=${T_OPT_MODEL:-220} MODEL_K="mosaic-fp4" STEPS=model session "$1"; }
# the fp4 GPU tests of the converter and the segment top-k (all but the ~10 GB cases), and issue #5's fp4 rows
FP4_SEG_TESTS="gpu and fp4 and (converter or segment or auto_set or pruned or wide_group) and not 768 and not 640 \
and not past_1024"
FP4_ROWS="64x1x131072xfp4,64x1x1048576xfp4,16x1x131072xfp4,64x1x65536xfp4"
if [ -n "$CONV_SYNC" ]; then   # session 74: conv_sync "arrive" (the fp4 converter's hand-over without a warpgroup
  # barrier, the scorer issuing the key copies; run in session 75, h100_s75r1: passed, no faster): its GPU cases, its
  # timing against the default ("commit") and "early" (HIST=1 runs "early" itself), the phase profile; then, unless
  # NO_MODEL is set, the fp4-key model test with "arrive" set as the default in this copy of the tree
  NO_MODEL=1 fp4_option conv_sync_arrive "gpu and fp4_converter and arrive" \
    "topk=auto_set,mosaic.conv_sync=arrive;topk=auto_set,mosaic.conv_sync=early" "$FP4_ROWS" \
    "fp4_64x128k,fp4_64x128k_arrive,fp4_64x64k_arrive_detail"
  if [ -z "$NO_MODEL" ]; then
    sed -i 's/^\( *\)conv_sync="commit", seg_hist=/\1conv_sync="arrive", seg_hist=/' pallas_kernels/indexer/gpu_mosaic.py
    grep -n 'conv_sync="arrive", seg_hist=' pallas_kernels/indexer/gpu_mosaic.py || exit 1
    fp4_model conv_sync_arrive_model
  fi
  exit
fi
if [ -n "$HIST" ]; then   # sessions 75-76: conv_sync "early" (the fp4 converter issues its key copies right after
  # the conversion), seg_hist "converter" (it counts the segment top-k's streamed histogram; the scorer's loop keeps
  # no barrier), select_wgs 2 (it joins the selection after its last block), q_prep "fused" (the scorer prepares q);
  # timed against the defaults on issue #5's fp4 rows (early alone, early + hist, + select_wgs 2, fused alone, all
  # four, and early + hist at 8 splits: two waves, whose selection tails can overlap the other wave's stream);
  # their phase profiles; then all four set as the defaults in this copy of the tree: the fp4 GPU tests of the
  # segment top-k (SEG_SYNC's list), the converter's rows-layout cases and each option's own cases; the second call
  # (HIST_TIMING=1) times them again and runs the fp4-key model test on those defaults
  ALL4="mosaic.seg_hist=converter,mosaic.conv_sync=early,mosaic.select_wgs=2,mosaic.q_prep=fused"
  T_idx=${T_HIST_IDX:-200} STEPS=idx IDX_ARGS="--skip-topk-only --variants pallas_auto_set --set-configs \
topk=auto_set,mosaic.conv_sync=early;topk=auto_set,mosaic.seg_hist=converter,mosaic.conv_sync=early;\
topk=auto_set,mosaic.seg_hist=converter,mosaic.conv_sync=early,mosaic.select_wgs=2;\
topk=auto_set,mosaic.q_prep=fused;topk=auto_set,$ALL4;\
topk=auto_set,mosaic.seg_hist=converter,mosaic.conv_sync=early,num_splits=8 --cases $FP4_ROWS" session hist_timing
  # q_prep "fused" on fp8 keys too (~40 s)
  T_idx=${T_HIST_FP8:-80} STEPS=idx IDX_ARGS="--skip-topk-only --variants pallas_auto_set --set-configs \
topk=auto_set,mosaic.q_prep=fused --cases 64x1x131072xfp8,16x1x131072xfp8,64x1x8192xfp8" session hist_fp8_timing
  set_all4() {
    sed -i -e 's/^\( *\)conv_sync="commit", seg_hist="scorer", select_wgs=1)$/\1conv_sync="early", seg_hist="converter", select_wgs=2)/' \
      -e 's/^MOSAIC_CONFIG = dict(q_prep="triton", /MOSAIC_CONFIG = dict(q_prep="fused", /' pallas_kernels/indexer/gpu_mosaic.py
    grep -n 'conv_sync="early", seg_hist="converter", select_wgs=2)' pallas_kernels/indexer/gpu_mosaic.py || exit 1
    grep -n '^MOSAIC_CONFIG = dict(q_prep="fused", ' pallas_kernels/indexer/gpu_mosaic.py || exit 1
  }
  if [ -n "$HIST_TIMING" ]; then   # the second call: the fp4-key model test on all four (~220 s)
    if [ -z "$NO_MODEL" ]; then set_all4; fp4_model hist_model; fi
    exit
  fi
  T_iprof=${T_HIST_PROF:-130} IPROF_ARGS="--cases fp4_64x128k_early,fp4_64x64k,fp4_64x64k_early_hist,\
fp4_64x64k_early_hist_s2,fp4_64x64k_all" STEPS=iprof session hist_profile
  set_all4
  # ~47 cases (~120 s at 4 workers): the segment top-k's fp4 cases, the converter's rows-layout cases (conv_sync
  # "early" now their default), the options' own cases (converter_options, fused_q_prep: fp4 and fp8 keys)
  PYTEST_N=4 T_tests5=${T_HIST_TESTS:-200} STEPS=tests5 GPU_TEST_K="gpu and ((fp4 and (segment or auto_set or pruned \
or wide_group) and not 768 and not 640 and not past_1024) or (fp4_converter and rows and not arrive and not early) \
or fused_q_prep)" session hist_tests
  exit
fi
if [ -n "$SEG_SYNC" ]; then   # session 74 (run in call 3): seg_sync "barrier" (the fp4 scorer's one barrier a block
  # under the segment top-k): its GPU tests (the converter and segment top-k fp4 cases but the ~10 GB ones), its
  # timing against "commit" (the code before) on issue #5's fp4 rows, the phase profile on it, the fp4-key model test
  fp4_option seg_sync "$FP4_SEG_TESTS" "topk=auto_set,mosaic.seg_sync=commit" \
    "64x1x131072xfp4,16x1x131072xfp4,64x1x1048576xfp4,1x1x131072xfp4" \
    "fp4_64x128k,fp4_64x64k_detail,fp4_64x64k_commit_detail"
  exit
fi
if [ -n "$IDX_PROF" ]; then   # session 74: the Mosaic indexer kernel's phase profile (scorer and fp4 converter, a key
  # block at a time: benchmarks/indexer_phase_profile.py), then issue #5's rows unless NO_IDX_TABLE is set
  T_iprof=${T_IPROF:-330} IPROF_ARGS="${IPROF_ARGS:---cases fp4_64x128k,fp4_64x128k_noselect,fp4_16x128k,\
fp4_64x128k_cv1,fp8_64x128k}" STEPS=iprof session indexer_profile
  if [ -z "$NO_IDX_TABLE" ]; then indexer_table; fi
  exit
fi
if [ -n "$IDX_TABLE" ]; then   # issue #5's indexer rows alone (PART=1's second step on an H200)
  indexer_table; exit
fi
if [ "${PART:-1}" = 0 ]; then model_asym; exit; fi
case "$card:${PART:-1}" in
  *H200*:1)
    decode_table
    indexer_table ;;
  *H200*:2) asym ;;
  *H200*:3) asym_fp8_and_profile ;;
  *H200*:4) conv_asym ;;
  *H200*:*) asym_conv_units ;;
  *:1) decode_table ;;
  *:2) asym_conv_units ;;
  *:3) conv_asym ;;
  *:4) asym ;;
  *) asym_fp8_and_profile ;;
esac
