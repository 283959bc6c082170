#!/usr/bin/env bash
# Twelfth session, last call (~2 min of work): the FP8-MMA experts from 8K-token prefills
# (MIN_PAIRS_PER_EXPERT 192, K-chunk-major stacks) — the expert bench at 4K / 8K tokens and
# the 4-layer 4K / 8K prefill.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage fp8k 50 python bench/moe_prefill_fp8.py --tokens 4096,8192 --out "$LOGS/fp8k.json"
stage pre 110 python bench/flash_bench.py --layers 4 --prefill 4096,8192 --decode-batches "" \
    --reps 2 --budget 100 --out "$LOGS/pre.json"
grep -h "^| [0-9]" "$LOGS"/fp8k.log
grep -h "prefill S" "$LOGS"/pre.log
