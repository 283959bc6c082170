#!/usr/bin/env bash
# Thirty-sixth session: the MXFP4 Gluon GEMMs on by default (DSV4_FP8MMA_MX) and taking calls
# from 96 pairs an expert (MIN_PAIRS_KEPT, no re-encoding to pay for): the GPU tests of the
# FP8-MMA experts and of kept codes in the engine, then the 4-layer prefill at 2K / 4K / 8K
# against DSV4_FP8MMA_MX=0 (4K: the bf16-MMA kernels there), alternating.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage gputests 200 python -m pytest -q -x tests/kernels/test_moe_fp8mma_gpu.py \
    tests/engine/test_moe_fp8_codes_gpu.py
for i in 1 2; do
    for v in 1 0; do
        DSV4_FP8MMA_MX=$v stage "small_${v}_$i" 90 python bench/flash_bench.py --layers 4 \
            --prefill 2048,4096,8192 --decode-batches "" --reps 3
        grep -h "prefill S=" "$LOGS/small_${v}_$i.log"
    done
done
