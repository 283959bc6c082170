#!/usr/bin/env bash
# Thirty-ninth session (~280 s): the small calls' 64-row MXFP4 plans (gluon_moe_mxfp4.plans_for)
# and the MXFP4 path from 48 pairs an expert (MIN_PAIRS_MX): their GPU tests; the expert call
# at 1K-3K tokens (V4-Flash, 256 experts) on the MXFP4 GEMMs against the bf16-MMA kernels;
# then 12 V4-Flash layers (256 experts) prefilling 2K / 1K tokens, eager and as piecewise
# graphs, against the thirty-eighth session's behaviour (MIN_PAIRS_MX 96, the 128-row plans
# at every size), alternating.
set -u
cd "$(dirname "$0")/../.."
export TCACHE_MAX_MB=0
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage tests 200 python -m pytest -q -x tests/kernels/test_moe_fp8mma_gpu.py -k "mx_gemms"
stage mxcall 120 python bench/moe_gluon_mx.py --tokens 1024,1536,2048,2560,3072 --plans ""
grep -h "call" "$LOGS/mxcall.log"
OLD=(env DSV4_FP8MMA_MIN_PAIRS_MX=96 DSV4_FP8MMA_MX_SMALL_PLANS=128:4:1:4:pdec2,128:4:1:4)
for i in 1 2; do
    stage "e_new_$i" 60 python bench/flash_bench.py --layers 12 --experts 256 \
        --prefill 1024,2048 --decode-batches "" --reps 7
    grep -h "prefill S=" "$LOGS/e_new_$i.log" | tail -n 2
    stage "e_old_$i" 60 "${OLD[@]}" python bench/flash_bench.py --layers 12 --experts 256 \
        --prefill 1024,2048 --decode-batches "" --reps 7
    grep -h "prefill S=" "$LOGS/e_old_$i.log" | tail -n 2
done
for i in 1; do
    stage "g_new_$i" 90 python bench/flash_bench.py --layers 12 --experts 256 \
        --prefill 2048 --prefill-graphs 2048 --decode-batches "" --reps 7
    grep -h "prefill S=" "$LOGS/g_new_$i.log" | tail -n 1
    stage "g_old_$i" 90 "${OLD[@]}" python bench/flash_bench.py --layers 12 --experts 256 \
        --prefill 2048 --prefill-graphs 2048 --decode-batches "" --reps 7
    grep -h "prefill S=" "$LOGS/g_old_$i.log" | tail -n 1
done
