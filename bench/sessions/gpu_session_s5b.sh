#!/usr/bin/env bash
# Fifth session, one H200, last call (< 5 min): the GEMV experts after the activation-slice
# rewrite and the FP8-MMA experts with 128-wide K steps (GPU tests + benches), then 4 V4-Flash
# layers end to end on the final defaults.
#   bash bench/sessions/gpu_session_s5b.sh       (logs and JSON packed into $OUT/session.tar.gz)
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage gemv_test 60 python -m pytest -q -p no:cacheprovider tests/kernels/test_moe_gemv.py -k gpu
stage gemv_bench 40 python bench/moe_gemv.py --no-sweep --out "$LOGS/moe_gemv.json"
stage fp8mma_test 50 python -m pytest -q -p no:cacheprovider tests/kernels/test_moe_fp8mma_gpu.py
stage fp8mma_bench 60 python bench/moe_prefill_fp8.py --sweep --out "$LOGS/fp8mma.json"
stage flash 100 python bench/flash_bench.py --layers 4 --prefill 8192 \
    --decode-batches 1,16,64 --ctx 8192 --steps 3 --budget 80 --out "$LOGS/flash.json"
