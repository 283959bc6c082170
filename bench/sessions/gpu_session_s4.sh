#!/usr/bin/env bash
# The next one-H200 session (< 9 min), written in the fourth session when its device time was
# spent: GPU checks of what still waits for them (the fp32 skinny GEMM `linear_fp32`, gated in
# dsv4.ops.UNVERIFIED_ON_GPU; the record-attention cases cut by the last run's time limit), the
# timings this session could not take (split-K experts: sweep of the splits; record attention;
# linear_fp32 against cuBLAS), then 4 V4-Flash layers end to end on the fp8 cache (the GPU
# default); the FP8-MMA expert path for prefill (checks and timing).
#   bash bench/sessions/gpu_session_s4.sh        (logs and JSON packed into $OUT/session.tar.gz)
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage gpu_tests 120 python -m pytest -q -p no:cacheprovider tests/kernels/test_gpu_kernels.py \
    -k "sparse_attn or linear32 or linear_fp32"
stage moe_decode 70 python bench/moe_decode.py --tokens 1,16 --sweep --out "$LOGS/moe.json"
stage kernels 90 python bench/kernels.py --only sparse_attn,linear_fp32 --out "$LOGS/kernels.json"
stage flash 120 python bench/flash_bench.py --layers 4 --prefill 8192 --decode-batches 1,16,64 \
    --ctx 8192 --steps 3 --budget 100 --out "$LOGS/flash.json" --profile "$LOGS/profile"
# The FP8-MMA expert path for prefill (dsv4.ops.triton_moe_fp8, off by default: written without a
# GPU): its GPU checks, then its time against the bf16-MMA kernels at 2K and 8K tokens.
stage gpu_fp8mma 50 python -m pytest -q -p no:cacheprovider tests/kernels/test_moe_fp8mma_gpu.py
stage fp8mma_bench 60 python bench/moe_prefill_fp8.py --tokens 2048,8192 --out "$LOGS/fp8mma.json"
