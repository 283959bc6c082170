#!/usr/bin/env bash
# s38b cut down (~100 s): the GPU test of the MXFP4 forms; the candidate plans (up pdec2, TMA-fed
# since the non-TMA persistent form was removed; down plain with 4 stages) against the
# defaults, GEMM by GEMM and in the 4-layer 8K prefill, alternating.
set -u
cd "$(dirname "$0")/../.."
export TCACHE_MAX_MB=0
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage mxtest 60 python -m pytest -q -x tests/kernels/test_moe_fp8mma_gpu.py -k "mx_gemms"
grep -h "passed\|failed\|Error" "$LOGS/mxtest.log" | tail -n 3
stage mxbench 80 python bench/moe_gluon_mx.py --tokens 8192,32768 \
    --plans up:128:4:1:4:dec,up:128:4:1:4:pdec2,down:128:4:1:3,down:128:4:1:4
grep -h "^|" "$LOGS/mxbench.log"
i=0
for p in "128:4:1:4:pdec2,128:4:1:4" "" "128:4:1:4:pdec2,128:4:1:4" "" ; do
    i=$((i + 1))
    DSV4_FP8MMA_MX_PLANS=$p stage "ab_$i" 40 python bench/flash_bench.py --layers 4 \
        --prefill 8192 --decode-batches "" --reps 3
    echo "plans '${p}': $(grep -h "prefill S=" "$LOGS/ab_$i.log" | tail -n 1)"
done
