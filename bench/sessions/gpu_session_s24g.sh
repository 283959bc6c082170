#!/usr/bin/env bash
# Twenty-fourth session, run G: does the 2-warp mHC post + mixes pay at decode sizes too?  The
# sweep at 1-8 tokens, and the 4-layer decode step at B = 16 / 32 with it from 16 tokens
# (DSV4_HC_POST_PRE_MID_T=16) against the decode plan (=1024).
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage glue 60 python bench/sweep_glue.py --ops hc_post_pre --tokens 1,2,4,8 --budget 50
stage dec16 100 env DSV4_HC_POST_PRE_MID_T=16 python bench/flash_bench.py --layers 4 \
    --prefill "" --decode-batches 16,32 --ctx 4096 --steps 2
stage dec1024 80 env DSV4_HC_POST_PRE_MID_T=1024 python bench/flash_bench.py --layers 4 \
    --prefill "" --decode-batches 16,32 --ctx 4096 --steps 2
grep -h "hc_post_pre" "$LOGS/glue.log" | head -30
grep -h "decode B=" "$LOGS/dec16.log" "$LOGS/dec1024.log"
