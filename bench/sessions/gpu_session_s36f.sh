#!/usr/bin/env bash
# Thirty-sixth session: the MXFP4 Gluon GEMMs with the shorter decode (one prmt for magnitude +
# exponent add per 4 codes, shared masks): the GPU test (bits), the default plans and the call
# at 8K / 32K, the 4-layer prefill against the re-encoding once.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage mxtest 120 python -m pytest -q -s tests/kernels/test_moe_fp8mma_gpu.py -k "mx_gemms"
grep -h "mx vs" "$LOGS/mxtest.log"
stage mxcall 120 python bench/moe_gluon_mx.py --tokens 8192,32768 \
    --plans up:128:4:1:3:ws,down:128:4:1:3
for v in 1 0; do
    DSV4_FP8MMA_MX=$v stage "mx_$v" 90 python bench/flash_bench.py --layers 4 \
        --prefill 8192,32768 --decode-batches "" --reps 3
    grep -h "prefill S=" "$LOGS/mx_$v.log"
done
