#!/usr/bin/env bash
# (Historical: plan texts pdec[N]t were the TMA-fed persistent form; since 95dc797 every
# persistent plan is TMA-fed and the text is pdec[N].)
# Thirty-seventh session, the last few minutes of device time: the chained persistent plans
# against the defaults at 8K tokens (bits against the Triton kernels), their GPU test, the
# 4-layer 8K prefill with them against the defaults.
set -u
cd "$(dirname "$0")/../.."
export TCACHE_MAX_MB=0
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name --format=csv,noheader
stage mxbench 90 python bench/moe_gluon_mx.py --tokens 8192 \
    --plans up:128:4:1:4:dec,up:128:4:1:4:pdec2,down:128:4:1:3,down:128:4:1:4:pdec4,up:128:4:1:4:pdec2t,down:128:4:1:4:pdec4t
grep -h "^|" "$LOGS/mxbench.log"
stage mxtest 75 python -m pytest -q -x tests/kernels/test_moe_fp8mma_gpu.py -k "mx_gemms and chain"
grep -h "passed\|failed\|Error" "$LOGS/mxtest.log" | tail -n 3
for p in "128:4:1:4:pdec2,128:4:1:4:pdec4" "" ; do
    DSV4_FP8MMA_MX_PLANS=$p stage "ab_${p:0:12}" 45 python bench/flash_bench.py --layers 4 \
        --prefill 8192 --decode-batches "" --reps 3
    echo "plans '${p}':"; grep -h "prefill S=" "$LOGS/ab_${p:0:12}.log" | tail -n 1
done
