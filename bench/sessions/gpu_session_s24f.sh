#!/usr/bin/env bash
# Twenty-fourth session, run F: more expert tiles at 512-4,096 tokens (16 / 32-row blocks, other
# pipeline depths) and the mHC post + mixes at 16-48 tokens (where the 2-warp plan starts to pay).
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage moe 240 python bench/moe_decode.py --sweep --tokens 512,1024,2048,4096 --out "$LOGS/moe.json"
stage glue 120 python bench/sweep_glue.py --ops hc_post_pre --tokens 16,32,48 --budget 100 \
    --out "$LOGS/glue.json"
grep -h "| 512 \|| 1024 \|| 2048 \|| 4096 " "$LOGS/moe.log" | head -60
grep -h "hc_post_pre" "$LOGS/glue.log" | head -30
