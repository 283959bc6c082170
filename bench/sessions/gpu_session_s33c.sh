#!/usr/bin/env bash
# Thirty-third session, second call: the 4-layer 8K prefill with the expert GEMMs block-first and
# N-tiles-first (DSV4_MOE_N_FIRST, separate processes, alternating), then 43 layers at B=1 with
# the new routing and the w2-without-PDL A/B.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
precompile_stage 90
for v in 0 1 0 1; do
    DSV4_MOE_N_FIRST=$v stage "prefill_nfirst$v" 100 python bench/flash_bench.py --layers 4 \
        --prefill 2048,8192 --decode-batches "" --reps 2
    grep -h "prefill" "$LOGS/prefill_nfirst$v.log" | tail -n 3
done
# Where the 4-layer 8K prefill goes now (eager, torch.profiler; last profiled in the thirteenth
# session), with the faster order if order.json says N tiles first won.
stage prof 120 python bench/flash_bench.py --layers 4 --prefill 8192 --decode-batches "" \
    --reps 1 --profile "$OUT/prefill_prof.txt"
stage b1_43 200 python bench/flash_bench.py --layers 43 --experts $EXPERTS --prefill "" \
    --decode-batches 1 --ctx 8192 --steps 2 --launch-ab --ab-variants "pdl;pdl, wgmma w2 without PDL"
grep -h "decode B=1\|model built" "$LOGS/b1_43.log" | tail -n 3
