#!/usr/bin/env bash
# Thirty-fifth session: the prefill expert GEMMs on FP8 codes in Gluon (TMA ring; plain, the previous
# step's rescale beside the next wgmma, warp-specialized; bench/moe_gluon_prefill.py) against the Triton
# kernels, bits and µs; their GPU test; then cuBLAS's block-scaled GEMM an expert at 8K tokens
# (bench/moe_cublas.py, the thirty-fourth session's, not run yet).
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage gluon 130 python bench/moe_gluon_prefill.py --tokens 8192 --out "$LOGS/gluon.json"
grep -h "^| \|^[0-9]* experts" "$LOGS/gluon.log"
stage gluontest 90 python -m pytest -q -x tests/kernels/test_moe_fp8mma_gpu.py -k gluon
stage gluon32 100 python bench/moe_gluon_prefill.py --tokens 32768 --out "$LOGS/gluon32.json"
grep -h "^| " "$LOGS/gluon32.log"
stage cublas 150 python bench/moe_cublas.py --tokens 8192 --streams 1,4 --out "$LOGS/cublas.json"
grep -h "^| \|scale_b\|moe_cublas" "$LOGS/cublas.log"
