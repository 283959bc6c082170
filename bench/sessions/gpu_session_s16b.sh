#!/usr/bin/env bash
# Sixteenth session, second call (~7 min): the issue #5 table at the current code — prefill
# 1K / 8K / 32K, decode B 1 / 16 / 64 / 256 at an 8K context (4 V4-Flash layers).
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage pre 220 python bench/flash_bench.py --layers 4 --prefill 1024,8192,32768 \
    --decode-batches "" --reps 2 --budget 200 --out "$LOGS/pre.json"
stage dec 220 python bench/flash_bench.py --layers 4 --prefill "" \
    --decode-batches 1,16,64,256 --ctx 8192 --steps 2 --budget 200 --out "$LOGS/dec.json"
grep -h "prefill\|decode B" "$LOGS"/pre.log "$LOGS"/dec.log | tail -n 20
