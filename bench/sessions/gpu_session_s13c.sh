#!/usr/bin/env bash
# Thirteenth session, third call (~4 min): (1) the L2 experiment — l2_prefetch's GPU test and
# bench/l2_prefetch.py (a decode GEMV from a warmed L2, and a side-stream prefetch behind a
# spin); (2) where the 8K prefill's GPU sits idle (flash_bench --gaps: 86 ms measured against
# 74 ms of kernels in s13b).
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage tests 60 python -m pytest -q -x tests/kernels/test_l2_prefetch.py
stage l2 90 python bench/l2_prefetch.py --out "$LOGS/l2.json"
stage gaps 200 python bench/flash_bench.py --layers 4 --prefill 8192 --decode-batches "" \
    --ctx 8192 --reps 2 --budget 180 --gaps "$LOGS/gaps.txt" --out "$LOGS/gaps.json"
cat "$LOGS"/l2.log
grep -h "prefill" "$LOGS"/gaps.log | tail -n 2
head -n 60 "$LOGS"/gaps.txt
tail -n 3 "$LOGS"/tests.log
