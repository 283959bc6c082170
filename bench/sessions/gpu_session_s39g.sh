#!/usr/bin/env bash
# Thirty-ninth session (~90 s): the 64-row MXFP4 plans at 60 pairs an expert (2.5K tokens,
# the gap between SMALL_PAIRS and MIN_PAIRS_MX_WIDE) against the 128-row ones; the 12-layer
# 2K prefill as piecewise graphs again, against the earlier thresholds and plans.
set -u
cd "$(dirname "$0")/../.."
export TCACHE_MAX_MB=0
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage gap 60 python bench/moe_gluon_mx.py --tokens 2560 \
    --plans up:128:4:1:4:pdec2,up:64:4:1:4,down:128:4:1:4,down:64:4:1:4
grep -h "^| 2560" "$LOGS/gap.log"
OLD=(env DSV4_FP8MMA_MIN_PAIRS_MX=96 DSV4_FP8MMA_MX_SMALL_PLANS=128:4:1:4:pdec2,128:4:1:4)
stage g_old 60 "${OLD[@]}" python bench/flash_bench.py --layers 12 --experts 256 \
    --prefill 2048 --prefill-graphs 2048 --decode-batches "" --reps 7
grep -h "prefill S=" "$LOGS/g_old.log" | tail -n 1
stage g_new 60 python bench/flash_bench.py --layers 12 --experts 256 \
    --prefill 2048 --prefill-graphs 2048 --decode-batches "" --reps 7
grep -h "prefill S=" "$LOGS/g_new.log" | tail -n 1
