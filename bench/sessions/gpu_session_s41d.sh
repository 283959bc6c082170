#!/usr/bin/env bash
# Forty-first session, with ~250 s of budget left: the gates-once plan's GPU bit tests and the
# post + mixes plans at 8K tokens (no end-to-end run).
set -u
cd "$(dirname "$0")/../.."
export TCACHE_MAX_MB=0
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name --format=csv,noheader
stage tests 75 python -m pytest -q -rf tests/kernels/test_hc_fused.py -k "gates or plans_agree"
tail -n 4 "$LOGS/tests.log"
stage sweep 60 python bench/sweep_glue.py --ops hc_post_pre --tokens 8192 --budget 50 \
    --out "$LOGS/sweep.json"
grep -h "^|" "$LOGS/sweep.log"
