#!/usr/bin/env bash
# Thirty-fourth session, after gpu_session_s34a.sh: 43 layers' 8K prefill with the experts'
# re-encoding ahead (DSV4_FP8MMA_AHEAD) and in order, alternating; one 4-layer 8K profile ahead.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
precompile_stage 70
for v in 1 0 1; do
    DSV4_FP8MMA_AHEAD=$v stage "p43_ahead$v" 110 python bench/flash_bench.py --layers 43 \
        --experts $EXPERTS --prefill 8192 --decode-batches "" --reps 2
    grep -h "prefill S\|model built" "$LOGS/p43_ahead$v.log" | tail -n 2
done
DSV4_FP8MMA_AHEAD=1 stage prof4 90 python bench/flash_bench.py --layers 4 --prefill 8192 \
    --decode-batches "" --reps 2 --profile "$LOGS/prof4.txt"
head -n 40 "$LOGS/prof4.txt"
