#!/usr/bin/env bash
# Eleventh session, closing table: 4 V4-Flash layers on the session's final tree (the joined
# FP8 up kernel removed, the coded activations and register caps reverted): 8K prefill and
# decode B 1 / 16 / 64 with the launch variants (bits of every variant against plain).
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage final 330 python bench/flash_bench.py --layers 4 --prefill 8192 --decode-batches 1,16,64 \
    --ctx 8192 --steps 2 --reps 2 --launch-ab --budget 300 --out "$LOGS/final.json"
grep -h "moe B\|prefill S\|decode B" "$LOGS"/final.log | tail -n 8
