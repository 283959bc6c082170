#!/usr/bin/env bash
# Thirty-fourth session, written for the next: would the prefill experts' FP8 GEMMs run faster
# through cuBLAS's 1x128 block-scaled FP8 GEMM, one call an expert (bench/moe_cublas.py)?  Then,
# on an H200, the 43-layer targets with N tiles first (gpu_session_s33g.sh's).
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage cublas 200 python bench/moe_cublas.py --tokens 8192,32768 --streams 1,4 --out "$LOGS/cublas.json"
grep -h "^| \|scale_b\|moe_cublas" "$LOGS/cublas.log"
stage cublas64 90 python bench/moe_cublas.py --tokens 8192 --experts 64
grep -h "^| [0-9]" "$LOGS/cublas64.log"
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
    TCACHE_MAX_MB=0 SKIP_BLOCKS=1 bash bench/sessions/gpu_session_s33e.sh
fi
