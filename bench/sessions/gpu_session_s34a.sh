#!/usr/bin/env bash
# Thirty-fourth session: the experts' re-encoding started when the layer starts
# (DSV4_FP8MMA_AHEAD=1, triton_moe_fp8.encode_ahead), beside the attention instead of before the
# expert GEMMs.  Its GPU tests (V4-Flash widths, the engine's greedy tokens), then the 4-layer
# prefill at 4K / 8K / 32K tokens in order and ahead, separate processes alternating, and ahead
# with the FP8-MMA path from 96 pairs an expert (4K tokens of V4-Flash).
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage tests 200 python -m pytest -q -x tests/kernels/test_moe_fp8mma_gpu.py -k "ahead" \
    tests/engine/test_moe_fp8_codes_gpu.py
i=0
for v in 0 1 0 1; do
    i=$((i + 1))
    DSV4_FP8MMA_AHEAD=$v stage "p4_${i}_$v" 75 python bench/flash_bench.py --layers 4 \
        --prefill 4096,8192,32768 --decode-batches "" --reps 3
    grep -h "prefill S" "$LOGS/p4_${i}_$v.log"
done
DSV4_FP8MMA_AHEAD=1 DSV4_FP8MMA_MIN_PAIRS=96 stage p4_min96 75 python bench/flash_bench.py \
    --layers 4 --prefill 4096 --decode-batches "" --reps 3
grep -h "prefill S" "$LOGS/p4_min96.log"
