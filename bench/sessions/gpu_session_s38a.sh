#!/usr/bin/env bash
# (Historical: plan texts pdec[N]t were the TMA-fed persistent form; since 95dc797 every
# persistent plan is TMA-fed and the text is pdec[N].)
# Thirty-eighth session: the TMA-fed persistent MXFP4 plans (fastest in s37b: up pdec2t 6%
# faster than the default, down pdec4t 10% slower than the plain default) swept over chain
# and stages, after the load warp's activation scales became cp.async (they waited a global
# load's latency each step); the GPU test of every form; the 4-layer 8K prefill with up
# pdec2t against the defaults.
set -u
cd "$(dirname "$0")/../.."
export TCACHE_MAX_MB=0
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage mxbench 240 python bench/moe_gluon_mx.py --tokens 8192,32768 \
    --plans up:128:4:1:4:dec,up:128:4:1:4:pdect,up:128:4:1:4:pdec1t,up:128:4:1:4:pdec2t,up:128:4:1:3:pdec2t,up:128:4:1:4:pdec4t,up:128:4:1:4:pdec2,down:128:4:1:4:pdec2,down:128:4:1:3,down:128:4:1:4,down:128:4:1:4:pdect,down:128:4:1:4:pdec1t,down:128:4:1:4:pdec2t,down:128:4:1:3:pdec2t,down:128:4:1:5:pdec2t,down:128:4:1:6:pdec2t,down:128:4:1:5:pdec4t
grep -h "^|" "$LOGS/mxbench.log"
stage mxtest 110 python -m pytest -q -x tests/kernels/test_moe_fp8mma_gpu.py -k "mx_gemms"
grep -h "passed\|failed\|Error" "$LOGS/mxtest.log" | tail -n 5
for p in "128:4:1:4:pdec2t,128:4:1:3" "" "128:4:1:4:pdec2t,128:4:1:3" "" ; do
    DSV4_FP8MMA_MX_PLANS=$p stage "ab_${p:0:12}" 60 python bench/flash_bench.py --layers 4 \
        --prefill 8192 --decode-batches "" --reps 3
    echo "plans '${p}':"; grep -h "prefill S=" "$LOGS/ab_${p:0:12}.log" | tail -n 1
done
