#!/usr/bin/env bash
# Twenty-fourth session, run D: plans at the token counts of short prompts and mixed steps
# (64-2,048 tokens), which no sweep covered: the mHC post + mixes (decode and prefill candidates
# both) and the routed experts' MXFP4 tiles (256 experts, top-6).
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage glue 200 python bench/sweep_glue.py --ops hc_post_pre,hc_pre --tokens 64,128,256,512,1024 \
    --budget 180 --out "$LOGS/glue.json"
stage moe 300 python bench/moe_decode.py --sweep --tokens 128,512,1024,2048 --out "$LOGS/moe.json"
grep -h "\*" "$LOGS/glue.log" | head -40
grep -h "best\|\*" "$LOGS/moe.log" | head -40
