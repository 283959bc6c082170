#!/usr/bin/env bash
# Twelfth session, last call (~2 min of work): the decode plan and activation prep in one launch
# (moe_plan_prep, <= 64 pairs) — the plan / expert GPU tests, then the 4-layer decode B 1.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage tests 100 python -m pytest -q -x tests/kernels/test_moe_fast.py
stage dec 80 python bench/flash_bench.py --layers 4 --prefill "" --decode-batches 1 \
    --ctx 8192 --steps 2 --budget 70 --out "$LOGS/dec.json"
grep -h "decode B\|moe B" "$LOGS"/dec.log | tail -n 4
tail -n 3 "$LOGS"/tests.log
