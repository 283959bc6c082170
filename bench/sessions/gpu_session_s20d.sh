#!/usr/bin/env bash
# Twentieth session, run D: the engine option moe_fp8_codes end to end (its GPU test), the
# FP8-MMA expert GPU tests, the 4-layer prefill at 1K-32K tokens with the kept codes.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage engine 180 python -m pytest -q -x tests/engine/test_moe_fp8_codes_gpu.py
stage fp8mma 200 python -m pytest -q -x tests/kernels/test_moe_fp8mma_gpu.py
stage pre_kept 200 python bench/flash_bench.py --layers 4 --prefill 1024,2048,32768 \
    --moe-fp8-codes --decode-batches "" --reps 2 --budget 180 --out "$LOGS/pre_kept.json"
tail -n 3 "$LOGS/engine.log" "$LOGS/fp8mma.log"
grep -h "prefill S=\|kept FP8\|Error" "$LOGS/pre_kept.log" | tail -n 6
