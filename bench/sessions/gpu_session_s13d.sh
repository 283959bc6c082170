#!/usr/bin/env bash
# Thirteenth session, fourth call (~4 min): s13c's two parts again after their fixes — the L2
# experiment (l2_prefetch GPU test, bench/l2_prefetch.py) and the 8K prefill's idle gaps with
# Triton's driver launches attributed to their Python sites.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage tests 60 python -m pytest -q -x tests/kernels/test_l2_prefetch.py
stage l2 120 python bench/l2_prefetch.py --out "$LOGS/l2.json"
stage gaps 200 python bench/flash_bench.py --layers 4 --prefill 8192 --decode-batches "" \
    --ctx 8192 --reps 2 --budget 180 --gaps "$LOGS/gaps.txt" --out "$LOGS/gaps.json"
tail -n 8 "$LOGS"/l2.log
grep -h "prefill" "$LOGS"/gaps.log | tail -n 1
head -n 62 "$LOGS"/gaps.txt
tail -n 2 "$LOGS"/tests.log
