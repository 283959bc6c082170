#!/usr/bin/env bash
# The next one-H200 session (< 9 min), written at the end of the fifth: the GPU checks its run
# did not reach (the dense prefill sources — bit-identity of the records and dense paths under
# their own tile plans —, the mHC plan agreement, the GEMV / FP8-MMA experts after any change),
# then the whole 4-layer table of issue #5 (1K / 8K / 32K prefill, decode B = 1 / 16 / 64 / 256)
# and transformers at the same 4K context.
#   bash bench/gpu_session_s6.sh        (logs and JSON packed into $OUT/session.tar.gz)
set -u
cd "$(dirname "$0")/.."
source bench/gpu_stages.sh   # OUT, LOGS, stage
stage gpu_tests 150 python -m pytest -q -p no:cacheprovider -s \
    tests/model/test_dense_prefill_sources.py tests/kernels/test_hc_fused.py \
    tests/kernels/test_moe_gemv.py tests/kernels/test_moe_fp8mma_gpu.py
stage flash 200 python bench/flash_bench.py --layers 4 --prefill 1024,8192,32768 \
    --decode-batches 1,16,64,256 --ctx 8192 --steps 3 --budget 180 --out "$LOGS/flash.json"
stage flash_hf 100 python bench/flash_bench.py --layers 4 --prefill 4096 --decode-batches 1 \
    --ctx 4096 --steps 3 --budget 40 --hf "4096;1:4096" --out "$LOGS/flash_hf.json"
