#!/usr/bin/env bash
# Forty-first session, last resort (~270 s, any GPU; under a ~150 s call limit the stages that
# finish, the bit tests and the sweep, still come back): the gates-once plan only.  Its GPU bit
# tests, the post + mixes plans at 8K, one 4-layer 8K prefill each of the default and the
# fastest same-bits wide plan.
set -u
cd "$(dirname "$0")/../.."
export TCACHE_MAX_MB=0
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS, fastest_wide_plan
nvidia-smi --query-gpu=name --format=csv,noheader
stage tests 90 python -m pytest -q -rf tests/kernels/test_hc_fused.py -k "gates or plans_agree"
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
