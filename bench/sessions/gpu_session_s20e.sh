#!/usr/bin/env bash
# Twentieth session, run E: the 4-layer prefill at 2K and 32K tokens with and without the kept
# FP8 expert codes in one run each, and a profile of the 8K prefill with them.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage pre_default 120 python bench/flash_bench.py --layers 4 --prefill 2048,32768 \
    --decode-batches "" --reps 3 --budget 100 --out "$LOGS/pre_default.json"
stage pre_kept 120 python bench/flash_bench.py --layers 4 --prefill 2048,32768 --moe-fp8-codes \
    --decode-batches "" --reps 3 --budget 100 --out "$LOGS/pre_kept.json"
stage prof 150 python bench/flash_bench.py --layers 4 --prefill 8192 --moe-fp8-codes \
    --decode-batches "" --reps 2 --budget 130 --profile "$LOGS/prof.txt" --out "$LOGS/prof.json"
for p in default kept; do echo "prefill=$p"; grep -h "prefill S=\|Error" "$LOGS/pre_$p.log" | tail -n 4; done
head -n 45 "$LOGS/prof.txt"
