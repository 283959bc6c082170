#!/usr/bin/env bash
# (Historical: plan texts pdec[N]t were the TMA-fed persistent form; since 95dc797 every
# persistent plan is TMA-fed and the text is pdec[N].)
# Thirty-eighth session, second call: the activation scales back on plain loads (cp.async
# measured slower for the TMA-fed up GEMM, s38a); the candidate plans (up pdec2t, down plain
# with 4 stages) against the defaults, GEMM by GEMM and in the 4-layer 8K prefill, alternating.
set -u
cd "$(dirname "$0")/../.."
export TCACHE_MAX_MB=0
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage mxbench 150 python bench/moe_gluon_mx.py --tokens 8192,32768 \
    --plans up:128:4:1:4:dec,up:128:4:1:4:pdec2t,up:128:4:1:3:pdec2t,up:128:4:1:4:pdect,down:128:4:1:3,down:128:4:1:4,down:128:4:1:5,down:128:4:1:6:pdec2t
grep -h "^|" "$LOGS/mxbench.log"
i=0
for p in "128:4:1:4:pdec2t,128:4:1:4" "128:4:1:4:dec,128:4:1:4" "" "128:4:1:4:pdec2t,128:4:1:4" "128:4:1:4:dec,128:4:1:4" "" ; do
    i=$((i + 1))
    DSV4_FP8MMA_MX_PLANS=$p stage "ab_$i" 60 python bench/flash_bench.py --layers 4 \
        --prefill 8192 --decode-batches "" --reps 3
    echo "plans '${p}': $(grep -h "prefill S=" "$LOGS/ab_$i.log" | tail -n 1)"
done
