#!/usr/bin/env bash
# Written in the thirty-fifth session for the next: the warp-specialized Gluon expert GEMMs (the
# default on kept FP8 codes since cfd1d12 / b110073) in the model.  Their GPU tests with the
# default plans; the 4-layer 8K / 32K prefill with kept codes, Gluon (default) against the
# Triton GEMMs (DSV4_FP8MMA_GLUON=0), alternating in separate processes; then the skip of other
# chunks' blocks (DSV4_GLUON_WS_SKIP=1, written without a GPU) on the per-call re-encoding's
# chunks, where Gluon was slower without it (the expert call both ways, bits).
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage gluontest 90 python -m pytest -q -x tests/kernels/test_moe_fp8mma_gpu.py -k "gluon or kept"
for i in 1 2; do
    for v in kept 0; do
        DSV4_FP8MMA_GLUON=$v stage "kept_${v}_$i" 90 python bench/flash_bench.py --layers 4 \
            --prefill 8192,32768 --decode-batches "" --reps 3 --moe-fp8-codes
        grep -h "prefill S=" "$LOGS/kept_${v}_$i.log"
    done
done
for skip in 1 0; do
    DSV4_GLUON_WS_SKIP=$skip stage "skip_$skip" 90 python bench/moe_gluon_prefill.py \
        --tokens 8192,32768 --plans up:128:3:ws,down:256:4:ws
    grep -h "call, " "$LOGS/skip_$skip.log"
done
