#!/usr/bin/env bash
# Thirty-fourth session (run A), one call for little device time: one in-order / ahead pair of
# 4-layer prefills (8K, 32K) with the experts' re-encoding started when the layer starts
# (DSV4_FP8MMA_AHEAD), its GPU tests, then 43 layers' 8K prefill ahead and in order.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for v in 0 1; do
    DSV4_FP8MMA_AHEAD=$v stage "p4_$v" 55 python bench/flash_bench.py --layers 4 \
        --prefill 8192,32768 --decode-batches "" --reps 3
    grep -h "prefill S" "$LOGS/p4_$v.log"
done
stage tests 120 python -m pytest -q -x tests/kernels/test_moe_fp8mma_gpu.py -k "ahead" \
    tests/engine/test_moe_fp8_codes_gpu.py
for v in 1 0; do
    DSV4_FP8MMA_AHEAD=$v stage "p43_ahead$v" 100 python bench/flash_bench.py --layers 43 \
        --experts $EXPERTS --prefill 8192 --decode-batches "" --reps 2
    grep -h "prefill S\|model built" "$LOGS/p43_ahead$v.log" | tail -n 2
done
