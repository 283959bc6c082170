#!/usr/bin/env bash
# Written in the thirty-ninth session for the next (~420 s): DSV4_HW_BF16_ROUND=1 (the GPU's
# fp32 -> bf16 cast in round_to_bf16 instead of the integer form; offline the mHC post + mixes
# loop drops from 1,285 to 1,034 SASS instructions a turn) — the premise's bit test, every
# Triton kernel's GPU test with it on, then the 4-layer 8K prefill and B=1 / B=64 decode with
# it off and on, alternating; then the 64-row MXFP4 plans at 60 pairs an expert (s39g).
set -u
cd "$(dirname "$0")/../.."
export TCACHE_MAX_MB=0
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage premise 60 python -m pytest -q tests/kernels/test_gpu_kernels.py -k bf16_cast
stage tests_hw 240 env DSV4_HW_BF16_ROUND=1 python -m pytest -q tests/kernels/test_gpu_kernels.py \
    tests/kernels/test_triton_norm.py tests/kernels/test_hc_fused.py tests/kernels/test_mhc_norm.py \
    tests/model/test_attention_cuda.py -k "gpu or cuda"
for i in 1 2; do
    for v in 0 1; do
        DSV4_HW_BF16_ROUND=$v stage "p4_${v}_$i" 90 python bench/flash_bench.py --layers 4 \
            --prefill 8192 --decode-batches 1,64 --ctx 8192 --steps 2 --reps 3
        grep -h "prefill S=\|graph" "$LOGS/p4_${v}_$i.log" | tail -n 3
    done
done
stage gap 60 python bench/moe_gluon_mx.py --tokens 2560 \
    --plans up:128:4:1:4:pdec2,up:64:4:1:4,down:128:4:1:4,down:64:4:1:4
grep -h "^| 2560" "$LOGS/gap.log"
