#!/usr/bin/env bash
# Twentieth session, run J: the fp8-record attention GPU test at 2,048 tokens (the 64-head plan).
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage tests 100 python -m pytest -q -x tests/kernels/test_gpu_kernels.py -k "fp8_records"
tail -n 5 "$LOGS/tests.log"
