#!/usr/bin/env bash
# Thirty-seventh session: where the MXFP4 GEMMs should start (4-layer prefill at 2K / 3K
# tokens, 48 / 72 pairs an expert, with the FP8-MMA threshold at 48 and at the shipped 96,
# alternating); then the 43-layer 8K prefill target with the MXFP4 GEMMs and with the
# re-encoding (128 experts a layer on an H200, 64 on an H100: EXPERTS).
set -u
cd "$(dirname "$0")/../.."
export TCACHE_MAX_MB=0
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for m in 48 96 48 96; do
    DSV4_FP8MMA_MIN_PAIRS_KEPT=$m stage "thr_${m}_$SECONDS" 60 python bench/flash_bench.py \
        --layers 4 --prefill 2048,3072 --decode-batches "" --reps 3
    grep -h "prefill S=" "$LOGS"/thr_${m}_*.log | tail -n 2
done
for v in 1 0; do
    DSV4_FP8MMA_MX=$v stage "p43_${v}" 200 python bench/flash_bench.py --layers 43 \
        --experts $EXPERTS --prefill 8192 --decode-batches "" --reps 2 --budget 180
    grep -h "prefill S=" "$LOGS"/p43_${v}.log | tail -n 1
done
