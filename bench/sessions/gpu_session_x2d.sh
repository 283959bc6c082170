#!/usr/bin/env bash
# Fifth session, two H200s, last call: the full-size V4-Flash at concurrency 1, 16, 64 without
# the profiler (clean TPOT), after the linear_fp32 decode-row fix.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage tp_bench 330 torchrun --nproc-per-node 2 bench/tp_bench.py --layers 43 --ep --graphs \
    --budget 290 --trace --out "$LOGS/tp_flash.json"
grep -v "^c=.* step " "$LOGS/tp_bench.log" | tail -n 12
