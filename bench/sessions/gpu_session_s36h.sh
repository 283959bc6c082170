#!/usr/bin/env bash
# Thirty-sixth session: the decode-warpgroup up GEMM as the default plan: the GPU test (bits)
# and the call at 8K / 16K tokens.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
stage mxtest 90 python -m pytest -q -s tests/kernels/test_moe_fp8mma_gpu.py -k "mx_gemms"
grep -h "mx vs" "$LOGS/mxtest.log"
stage mxcall 80 python bench/moe_gluon_mx.py --tokens 8192,16384 \
    --plans up:128:4:1:3:ws,up:128:4:1:4:dec
