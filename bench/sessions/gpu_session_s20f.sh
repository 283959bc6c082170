#!/usr/bin/env bash
# Twentieth session, run F: cuBLAS's block-scaled FP8 GEMM (torch._scaled_mm, 1x128 / 128x128
# scales) against the Triton FP8 GEMM at V4-Flash's 8K-prefill shapes.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage cublas 150 python bench/fp8_cublas.py --tokens 8192
cat "$LOGS/cublas.log"
