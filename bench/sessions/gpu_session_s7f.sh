#!/usr/bin/env bash
# Seventh session, last check (one H200, < 3 min): the swept FP8 GEMV plans' GPU tests, then
# 4 layers at decode B = 1, 2 and 16 with the B=1 timeline.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage t_gemv 80 python -m pytest -q -p no:cacheprovider tests/kernels/test_fp8_gemv.py
stage flash 100 python bench/flash_bench.py --layers 4 --prefill "" --decode-batches 1,2,16 \
    --ctx 8192 --steps 3 --budget 80 --timeline "$LOGS/timeline.txt" --out "$LOGS/flash.json"
grep -h "^\[" "$LOGS"/flash.log | tail -n 6
tar -czf "$OUT/session.tar.gz" -C "$LOGS" .
