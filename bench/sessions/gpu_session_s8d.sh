#!/usr/bin/env bash
# Eighth session, last H200 call: transformers against dsv4 at a 4K context, batch 1 (the
# issue's ">= 50x" comparison, not re-measured since the sixth session), with PDL as landed.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage flash_hf 150 python bench/flash_bench.py --layers 4 --prefill 4096 --decode-batches 1 \
    --ctx 4096 --steps 3 --budget 60 --launch-ab --hf "4096;1:4096" --out "$LOGS/flash_hf.json"
grep "^\[" "$LOGS/flash_hf.log" | grep -v "moe B" | tail -n 10
tar -czf "$OUT/session.tar.gz" -C "$LOGS" .
