#!/usr/bin/env bash
# Fifth session, one H200 (< 9.5 min): GPU checks of what the session wrote (GEMV experts,
# mHC / prep tile plans, strided compressor rows, the dense prefill sources), the plan sweeps,
# then 4 V4-Flash layers end to end with the GEMV experts on, and the same workload at a
# 4,096-token context through transformers for the speed-up ratio of issue #5.
#   bash bench/sessions/gpu_session_s5.sh        (logs and JSON packed into $OUT/session.tar.gz)
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage gpu_tests 130 python -m pytest -q -x -p no:cacheprovider -s tests/kernels/test_moe_gemv.py \
    tests/kernels/test_hc_fused.py tests/model/test_dense_prefill_sources.py
stage gpu_tests2 60 python -m pytest -q -p no:cacheprovider tests/kernels/test_gpu_kernels.py \
    -k "compress or hc_ or prep"
stage sweep_glue 85 python bench/sweep_glue.py --out "$LOGS/sweep_glue.json"
stage moe_gemv 50 python bench/moe_gemv.py --out "$LOGS/moe_gemv.json"
DSV4_MOE_GEMV=1 stage flash 115 python bench/flash_bench.py --layers 4 --prefill 8192 \
    --decode-batches 1,16,64 --ctx 8192 --steps 3 --budget 95 --out "$LOGS/flash.json" \
    --profile "$LOGS/profile"
DSV4_MOE_GEMV=1 stage flash_hf 100 python bench/flash_bench.py --layers 4 --prefill 4096 \
    --decode-batches 1 --ctx 4096 --steps 3 --budget 40 --hf "4096;1:4096" \
    --out "$LOGS/flash_hf.json"
