#!/usr/bin/env bash
# Forty-second session, second call (~470 s, any GPU; after gpu_session_s42a.sh, whose tests
# stage checks the routing plan's bits): the rest of what the fortieth session wrote, and the
# issue's 4-layer table.  The chunked routing plan (DSV4_MOE_PLAN_CHUNKED=1): its forms' times
# (bench/prefill_glue.py) and the 4-layer 8K prefill against the default, alternating; then
# every Triton kernel's GPU tests with DSV4_HW_BF16_ROUND=1.
set -u
cd "$(dirname "$0")/../.."
export TCACHE_MAX_MB=0
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name --format=csv,noheader
stage glue 40 python bench/prefill_glue.py --tokens 2048,8192,32768
grep -h "routing plan" "$LOGS/glue.log"
# The issue's whole 4-layer table at the current code (last taken on an H200 in the sixteenth
# session): prefill 1K / 8K / 32K, decode B = 1 / 16 / 64 / 256 at 8K contexts.
stage table4 150 python bench/flash_bench.py --layers 4 --prefill 1024,8192,32768 \
    --decode-batches 1,16,64,256 --ctx 8192 --budget 135
grep -h "prefill S=\|decode B=" "$LOGS/table4.log"
for i in 1 2; do
    for v in base chunked; do
        env=""; [ $v = chunked ] && env="DSV4_MOE_PLAN_CHUNKED=1"
        stage "p4_${v}_$i" 55 env $env python bench/flash_bench.py --layers 4 --prefill 8192 \
            --decode-batches "" --reps 3
        grep -h "prefill S=" "$LOGS/p4_${v}_$i.log" | tail -n 1
    done
done
stage tests_hw 110 env DSV4_HW_BF16_ROUND=1 python -m pytest -q -x tests/kernels/test_gpu_kernels.py \
    tests/kernels/test_triton_norm.py tests/kernels/test_hc_fused.py tests/kernels/test_mhc_norm.py \
    -k "gpu or cuda or v4_flash"
tail -n 3 "$LOGS/tests_hw.log"
