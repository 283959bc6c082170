#!/usr/bin/env bash
# Thirty-sixth session: the Gluon GEMMs' GPU tests in every form (plain, lagged and WS_SKIP
# included), then the 4-layer 8K / 32K prefill on the per-call re-encoding (no kept codes) with
# Gluon everywhere and the skip of other chunks' blocks (DSV4_FP8MMA_GLUON=1
# DSV4_GLUON_WS_SKIP=1) against the Triton GEMMs (DSV4_FP8MMA_GLUON=0), alternating.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage gluontest 120 python -m pytest -q tests/kernels/test_moe_fp8mma_gpu.py -k "gluon"
for i in 1 2; do
    for v in 1 0; do
        DSV4_FP8MMA_GLUON=$v DSV4_GLUON_WS_SKIP=1 stage "reenc_${v}_$i" 90 python bench/flash_bench.py \
            --layers 4 --prefill 8192,32768 --decode-batches "" --reps 3
        grep -h "prefill S=" "$LOGS/reenc_${v}_$i.log"
    done
done
