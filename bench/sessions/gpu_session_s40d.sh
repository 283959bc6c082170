#!/usr/bin/env bash
# Fortieth session's last call (~200 s, the device budget's rest): the GPU tests of the
# explicit-FMA post + mixes with the gates once (bits against the per-chunk gates) and of the
# routing plan in chunks of 128 pairs; bench/prefill_glue.py (the plan's time); the post +
# mixes plans at 8K tokens (the gates once, about one wave of blocks).
set -u
cd "$(dirname "$0")/../.."
export TCACHE_MAX_MB=0
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name --format=csv,noheader
stage tests 90 python -m pytest -q -rf tests/kernels/test_hc_fused.py tests/kernels/test_moe_fast.py \
    -k "gates or plans_agree or plan"
tail -n 4 "$LOGS/tests.log"
stage glue 35 python bench/prefill_glue.py --tokens 2048,8192,32768
grep -h "routing plan" "$LOGS/glue.log"
stage sweep 70 python bench/sweep_glue.py --ops hc_post_pre --tokens 8192 --budget 60
grep -h "^|" "$LOGS/sweep.log"
