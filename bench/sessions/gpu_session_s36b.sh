#!/usr/bin/env bash
# Thirty-sixth session: the prefill expert GEMMs on the MXFP4 stacks, decoded in registers
# (dsv4/ops/gluon_moe_mxfp4.py, written without a GPU): the GPU test, then the GEMM plans and
# the whole call (kept codes / re-encoded / MXFP4) at 8K and 32K tokens.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage mxtest 120 python -m pytest -q -s tests/kernels/test_moe_fp8mma_gpu.py -k "mx_gemms"
grep -h "mx vs" "$LOGS/mxtest.log"
stage mxbench 240 python bench/moe_gluon_mx.py --tokens 8192,32768
