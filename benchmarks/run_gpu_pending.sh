#!/usr/bin/env bash
# The device work still pending, as one command that picks its steps by the card it lands on (the device tool gives
# an H100 or an H200, whichever comes; H200s have not come since session 55). Each part fits one 600 s call.
#   device run:  PART=1 bash benchmarks/run_gpu_pending.sh        (then PART=2 while the machine is warm)
# H200, part 1: issue #4's decode table on today's defaults with the XLA reference at B = 64, then issue #5's rows
#   (indexer decode at 8K / 128K / 1M, B = 1 and 64, each key format) on the defaults, against session 54's q
#   preparation grid of before (`mosaic.q_prep_heads=64`) in the same call.
# H200, part 2: `piece_barriers="pieces"` against the default (group s56), then the indexer GPU tests below.
# Any other card, either part: the indexer GPU tests that session 62 changed and did not run to their end:
#   test_gpu_segment_set_past_1024_rows on the default picks (auto_set -> segment_set past 1024 rows), alone, then
#   the segment tests whose large cases now draw their keys on the device (make_decode), in 3 pytest workers.
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
case "$card:${PART:-1}" in
  *H200*:1)
    T_attn=290 ATTN_ARGS="--groups decode --net-decode --ref-batches 64" STEPS=attn session decode_table
    T_idx=170 STEPS=idx IDX_ARGS="--skip-topk-only --variants pallas_auto_set \
--set-configs topk=auto_set,mosaic.q_prep_heads=64 --cases 64x1x131072xfp4,64x1x131072xfp8,64x1x131072xbf16,1x1x131072xfp4,1x1x131072xfp8,64x1x1048576xfp4,\
64x1x1048576xfp8,1x1x1048576xfp4,64x1x8192xfp8" session indexer_table ;;
  *H200*:2)
    T_attn=120 ATTN_ARGS="--groups s56 --net-decode --no-ref" STEPS=attn session pieces
    T_SEGMENT=270 indexer_tests ;;
  *) indexer_tests ;;
esac
