#!/usr/bin/env bash
# Sixteenth session, first call (~4 min): the bulk L2 prefetches — their GPU test, then
# bench/l2_bulk.py (GEMVs and the one-token routed experts after a bulk prefetch).
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage test 90 python -m pytest -q -x tests/kernels/test_l2_prefetch.py
stage bulk 240 python bench/l2_bulk.py --out "$LOGS/bulk.json"
grep -h "passed\|failed" "$LOGS"/test.log | tail -n 2
cat "$LOGS"/bulk.log | grep -v "^$" | tail -n 30
