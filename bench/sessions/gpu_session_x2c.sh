#!/usr/bin/env bash
# Fifth session, two H200s, second call (< 7 min): the full-size V4-Flash (43 layers, random
# weights made on the GPUs, EP, CUDA graphs under TP by default now, fp8 cache, official
# numerics) served at concurrency 1, 16 and 64 with 8K prompts; rank 0 profiles 4 decode steps.
#   bash bench/sessions/gpu_session_x2c.sh       (logs and JSON packed into $OUT/session.tar.gz)
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage tp_bench 360 torchrun --nproc-per-node 2 bench/tp_bench.py --layers 43 --ep --graphs \
    --budget 330 --trace --profile "$LOGS/tp_profile.txt" --out "$LOGS/tp_flash.json"
grep -v "^c=.* step " "$LOGS/tp_bench.log" | tail -n 30
