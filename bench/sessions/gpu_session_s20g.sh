#!/usr/bin/env bash
# Twentieth session, run G: fp8_linear's cuBLAS path for prefill-sized calls (new): its GPU
# tests and the FP8 GEMM GPU tests, the GEMMs at 512 / 2K / 8K rows, the 4-layer prefill with it
# (with and without the kept FP8 expert codes) and without it.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage tests 200 python -m pytest -q -x tests/kernels/test_fp8_cublas_gpu.py \
    tests/kernels/test_gpu_kernels.py -k "cublas or fp8"
stage gemm 120 python bench/fp8_cublas.py --tokens 512,2048,8192
DSV4_FP8_CUBLAS=0 stage pre_triton 100 python bench/flash_bench.py --layers 4 --prefill 4096,8192 \
    --decode-batches "" --reps 3 --budget 80 --out "$LOGS/pre_triton.json"
stage pre_cublas 100 python bench/flash_bench.py --layers 4 --prefill 4096,8192 \
    --decode-batches "" --reps 3 --budget 80 --out "$LOGS/pre_cublas.json"
stage pre_cublas_kept 100 python bench/flash_bench.py --layers 4 --prefill 4096,8192,32768 \
    --moe-fp8-codes --decode-batches "" --reps 3 --budget 80 --out "$LOGS/pre_cublas_kept.json"
tail -n 3 "$LOGS/tests.log"
cat "$LOGS/gemm.log"
for p in triton cublas cublas_kept; do echo "prefill=$p"; grep -h "prefill S=\|Error" "$LOGS/pre_$p.log" | tail -n 4; done
