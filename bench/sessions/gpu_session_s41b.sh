#!/usr/bin/env bash
# Forty-first session (~460 s, any GPU): gpu_session_s41a.sh cut to what decides the defaults,
# for when failed starts have eaten most of the budget.  The GPU bit tests of the explicit-FMA
# gates-once plan and both routing-plan forms; the plan forms' times; the post + mixes plans at
# 8K; one 4-layer 8K prefill each of the default, the fastest same-bits wide plan and the
# chunked routing plan, then the default again (drift check).
set -u
cd "$(dirname "$0")/../.."
export TCACHE_MAX_MB=0
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS, fastest_wide_plan
nvidia-smi --query-gpu=name --format=csv,noheader
stage tests 100 python -m pytest -q -rf tests/kernels/test_hc_fused.py tests/kernels/test_moe_fast.py \
    -k "gates or plans_agree or plan"
tail -n 4 "$LOGS/tests.log"
stage glue 40 python bench/prefill_glue.py --tokens 2048,8192,32768
grep -h "routing plan" "$LOGS/glue.log"
stage sweep 75 python bench/sweep_glue.py --ops hc_post_pre --tokens 8192 --budget 65 \
    --out "$LOGS/sweep.json"
grep -h "^|" "$LOGS/sweep.log"
best=$(fastest_wide_plan "$LOGS/sweep.json")
echo "fastest same-bits wide plan: ${best:-none}"
for v in base wide chunked base2; do
    case $v in
        base*) env="" ;;
        wide) env="DSV4_HC_WIDE_PLAN=${best:-4}" ;;
        chunked) env="DSV4_MOE_PLAN_CHUNKED=1" ;;
    esac
    stage "p4_$v" 60 env $env python bench/flash_bench.py --layers 4 --prefill 8192 \
        --decode-batches "" --reps 3
    grep -h "prefill S=" "$LOGS/p4_$v.log" | tail -n 1
done
