#!/usr/bin/env bash
# Sixth session, last minutes of one H200: prefill at 1K and 32K tokens (the issue's table) on
# the final code, then transformers vs dsv4 at a 4K context, batch 1.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage flash 120 python bench/flash_bench.py --layers 4 --prefill 1024,32768 --decode-batches 1 \
    --ctx 8192 --steps 3 --budget 100 --out "$LOGS/flash.json"
stage flash_hf 100 python bench/flash_bench.py --layers 4 --prefill 4096 --decode-batches 1 \
    --ctx 4096 --steps 3 --budget 40 --hf "4096;1:4096" --out "$LOGS/flash_hf.json"
grep "^\[" "$LOGS/flash.log" "$LOGS/flash_hf.log" | tail -n 14
tar -czf "$OUT/session.tar.gz" -C "$LOGS" .
