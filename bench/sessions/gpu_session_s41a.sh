#!/usr/bin/env bash
# Written in the fortieth session for the next (~560 s, any GPU): what that session wrote but
# could not run (its device budget went on failed starts).
# 1. GPU tests: the explicit-FMA post + mixes with the gates once (x_new, y, mixes bit for bit
#    against the per-chunk gates: before the explicit FMAs 141 of 134M x_new elements differed),
#    the default and fp32 plans still agreeing, the routing plan in both forms (one program per
#    expert; DSV4_MOE_PLAN_CHUNKED's chunks of 128 pairs) at up to 32K tokens.
# 2. bench/prefill_glue.py: the plan's forms (the per-expert kernel 82 / 156 / 151 µs at 2K / 8K
#    / 32K tokens with chunks of 1,024 sorted pairs, 43 / 197 / 803 µs per expert).
# 3. The post + mixes plans at 2K / 8K tokens (the gates once; about one wave of blocks: the 8K
#    default runs 640 blocks in 1.62 waves of 3 blocks an SM, Nsight Compute).
# 4. The 4-layer 8K prefill: the default, the sweep's fastest same-bits wide plan
#    (DSV4_HC_WIDE_PLAN), and the chunked plan (DSV4_MOE_PLAN_CHUNKED=1), alternating.
# 5. DSV4_HW_BF16_ROUND=1: every Triton kernel's GPU test with it (its premise passed in s40b).
set -u
cd "$(dirname "$0")/../.."
export TCACHE_MAX_MB=0
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS, fastest_wide_plan
nvidia-smi --query-gpu=name --format=csv,noheader
stage tests 120 python -m pytest -q -rf tests/kernels/test_hc_fused.py tests/kernels/test_moe_fast.py \
    -k "gates or plans_agree or plan"
tail -n 4 "$LOGS/tests.log"
stage glue 40 python bench/prefill_glue.py --tokens 2048,8192,32768
grep -h "routing plan" "$LOGS/glue.log"
stage sweep 90 python bench/sweep_glue.py --ops hc_post_pre --tokens 2048,8192 --budget 80 \
    --out "$LOGS/sweep.json"
grep -h "^|" "$LOGS/sweep.log"
best=$(fastest_wide_plan "$LOGS/sweep.json")
echo "fastest same-bits wide plan: ${best:-none}"
for i in 1 2; do
    for v in base wide chunked; do
        case $v in
            base) env="" ;;
            wide) env="DSV4_HC_WIDE_PLAN=${best:-4}" ;;
            chunked) env="DSV4_MOE_PLAN_CHUNKED=1" ;;
        esac
        stage "p4_${v}_$i" 60 env $env python bench/flash_bench.py --layers 4 --prefill 8192 \
            --decode-batches "" --reps 3
        grep -h "prefill S=" "$LOGS/p4_${v}_$i.log" | tail -n 1
    done
done
stage tests_hw 120 env DSV4_HW_BF16_ROUND=1 python -m pytest -q -x tests/kernels/test_gpu_kernels.py \
    tests/kernels/test_triton_norm.py tests/kernels/test_hc_fused.py tests/kernels/test_mhc_norm.py \
    -k "gpu or cuda or v4_flash"
tail -n 3 "$LOGS/tests_hw.log"
