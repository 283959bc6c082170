#!/usr/bin/env bash
# The next one-H200 session (< 9 min), written in the fourth session when its device time was
# spent: GPU checks of what still waits for them (the fp32 skinny GEMM `linear_fp32`, gated in
# dsv4.ops.UNVERIFIED_ON_GPU; the record-attention cases cut by the last run's time limit), the
# timings this session could not take (split-K experts: sweep of the splits; record attention;
# linear_fp32 against cuBLAS), then 4 V4-Flash layers end to end on the fp8 cache (the GPU
# default) and the engine's decode step against it.
#   bash bench/gpu_session_s4.sh        (logs and JSON packed into $OUT/session.tar.gz)
set -u
cd "$(dirname "$0")/.."
source bench/gpu_stages.sh   # OUT, LOGS, stage
stage gpu_tests 120 python -m pytest -q -p no:cacheprovider tests/kernels/test_gpu_kernels.py \
    -k "sparse_attn or linear32 or linear_fp32"
stage moe_decode 70 python bench/moe_decode.py --tokens 1,16 --sweep --out "$LOGS/moe.json"
stage kernels 90 python bench/kernels.py --only sparse_attn,linear_fp32 --out "$LOGS/kernels.json"
stage flash 120 python bench/flash_bench.py --layers 4 --prefill 8192 --decode-batches 1,16,64 \
    --ctx 8192 --steps 3 --budget 100 --out "$LOGS/flash.json" --profile "$LOGS/profile"
stage engine 100 python bench/engine_graphs.py --skip-tiny --ctx 8192 --batches 1,16 \
    --profile "$LOGS/engine_profile.txt" --out "$LOGS/engine_graphs.json"
