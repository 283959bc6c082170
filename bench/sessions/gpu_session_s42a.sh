#!/usr/bin/env bash
# Forty-second session (~540 s, any GPU; an H200 gives the issue's 43-layer targets): the
# gates-once post + mixes plan and the chunked routing plan checked bit for bit, the 8K post +
# mixes plans, one 4-layer 8K prefill each of the default and the fastest same-bits wide plan,
# then the 43-layer targets (8K prefill, B=1 and B=64 decode at 8K contexts).
set -u
cd "$(dirname "$0")/../.."
export TCACHE_MAX_MB=0
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS, fastest_wide_plan
nvidia-smi --query-gpu=name --format=csv,noheader
stage tests 110 python -m pytest -q -rf tests/kernels/test_hc_fused.py tests/kernels/test_moe_fast.py \
    -k "gates or plans_agree or plan"
tail -n 4 "$LOGS/tests.log"
stage sweep 60 python bench/sweep_glue.py --ops hc_post_pre --tokens 8192 --budget 50 \
    --out "$LOGS/sweep.json"
grep -h "^|" "$LOGS/sweep.log"
best=$(fastest_wide_plan "$LOGS/sweep.json")
echo "fastest same-bits wide plan: ${best:-none}"
for v in base wide; do
    env=""; [ $v = wide ] && env="DSV4_HC_WIDE_PLAN=${best:-4}"
    stage "p4_$v" 55 env $env python bench/flash_bench.py --layers 4 --prefill 8192 \
        --decode-batches "" --reps 3
    grep -h "prefill S=" "$LOGS/p4_$v.log" | tail -n 1
done
stage full43 240 python bench/flash_bench.py --layers 43 --experts $EXPERTS --prefill 8192 \
    --decode-batches 1,64 --ctx 8192 --steps 2 --reps 2 --budget 220
grep -h "prefill S=\|decode B=" "$LOGS/full43.log"
