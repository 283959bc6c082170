#!/usr/bin/env bash
# Written in the thirty-sixth session for the next: the 43-layer 8K prefill target with the
# MXFP4 Gluon GEMMs (DSV4_FP8MMA_MX, on by default since 1fd08e2) against the per-call
# re-encoding (DSV4_FP8MMA_MX=0), alternating, on whatever card comes (128 experts a layer on
# an H200, 64 on an H100: EXPERTS); where the 4-layer 8K prefill goes now (torch.profiler, 256
# experts); then the FP8-MMA GPU tests.  The thirty-first session's
# H200 number was 669.5 ms (4.29x the floor) with the re-encoding.
set -u
cd "$(dirname "$0")/../.."
export TCACHE_MAX_MB=0
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for v in 1 0; do
    DSV4_FP8MMA_MX=$v stage "p43_${v}_$SECONDS" 200 python bench/flash_bench.py --layers 43 \
        --experts $EXPERTS --prefill 8192 --decode-batches "" --reps 2 --budget 180
    grep -h "prefill S=" "$LOGS"/p43_${v}_*.log | tail -n 1
done
stage prof 120 python bench/flash_bench.py --layers 4 --prefill 8192 --decode-batches "" \
    --reps 1 --ctx 8192 --profile "$OUT/prefill_prof.txt"
grep -A 40 "prefill 8192" "$OUT/prefill_prof.txt" | head -n 45
stage tests 150 python -m pytest -q -x tests/kernels/test_moe_fp8mma_gpu.py -k "mx or gluon"
