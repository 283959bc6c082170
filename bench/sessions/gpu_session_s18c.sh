#!/usr/bin/env bash
# Eighteenth session, third call (~8 min): the FP8 GEMV's wide plan sweep at one row
# (bench/fp8_decode_sweep.py --gemv --sweep --wide: more K per step and per program, fewer
# splits), the two 33.5 MB output projections first (wo_b, the grouped wo_a), then the rest.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage wide_out 240 python bench/fp8_decode_sweep.py --gemv --sweep --wide --rows 1 \
    --shapes "wo_b,wo_a (grouped)" --out "$LOGS/wide_out.json"
stage wide_rest 280 python bench/fp8_decode_sweep.py --gemv --sweep --wide --rows 1 \
    --shapes "wq_b,shared_w1+w3,wq_a+wkv,shared_w2" --out "$LOGS/wide_rest.json"
grep -h "gemv\|^w\|^shared" "$LOGS"/*.log | tail -n 30
