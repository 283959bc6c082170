#!/usr/bin/env bash
# Twelfth session, fourth call (~8 min), K-chunk-major experts (the default layout now):
#   1. the FP8-MMA prefill experts at 8K / 32K tokens (bench/moe_prefill_fp8.py);
#   2. other decode plans at 1 / 2 tokens on the new layout (8 warps, narrower tiles, splits);
#   3. the 4-layer 16K / 32K prefill;
#   4. transformers on the 4-layer workload at a 4K context (issue #5's 50x target).
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage fp8pre 100 python bench/moe_prefill_fp8.py --tokens 8192,32768 --out "$LOGS/fp8pre.json"
stage plans 70 python bench/moe_decode_layout.py --tokens 1,2 \
    --plans 64/128/8/4/4,32/128/4/4/4,32/64/4/4/4,64/64/4/4/8,128/128/8/4/4,64/128/4/8/8,32/128/8/4/4 \
    --out "$LOGS/plans.json"
stage long 170 python bench/flash_bench.py --layers 4 --prefill 16384,32768 --decode-batches "" \
    --reps 2 --budget 150 --out "$LOGS/long.json"
stage hf 170 python bench/flash_bench.py --layers 4 --prefill 4096 --decode-batches 1 \
    --ctx 4096 --steps 3 --budget 60 --hf "4096;1:4096" --out "$LOGS/hf.json"
grep -h "^| [0-9]" "$LOGS"/fp8pre.log "$LOGS"/plans.log
grep -h "prefill S\|decode B\|transformers\|hf " "$LOGS"/long.log "$LOGS"/hf.log | grep -v "moe B" | tail -n 10
