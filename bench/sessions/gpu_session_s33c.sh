#!/usr/bin/env bash
# Thirty-third session, second call: the 4-layer 8K prefill with the expert GEMMs block-first and
# N-tiles-first (DSV4_MOE_N_FIRST, separate processes, alternating), then its profile.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
precompile_stage 90
i=0
for v in 0 1 0 1; do
    i=$((i + 1))
    DSV4_MOE_N_FIRST=$v stage "prefill${i}_nfirst$v" 100 python bench/flash_bench.py --layers 4 \
        --prefill 2048,8192 --decode-batches "" --reps 2
    grep -h "prefill" "$LOGS/prefill${i}_nfirst$v.log" | tail -n 3
done
# Where the 4-layer 8K prefill goes now (eager, torch.profiler; last profiled in the thirteenth
# session), with the faster order if order.json says N tiles first won.
stage prof 120 python bench/flash_bench.py --layers 4 --prefill 8192 --decode-batches "" \
    --reps 1 --profile "$OUT/prefill_prof.txt"
