#!/usr/bin/env bash
# Thirty-first session's fifth call: where a B=16 / B=64 decode step goes (4 layers, graph
# timelines), to find the lever that keeps the B=64 target (2.00x at 43 layers) met.
set -u
cd "$(dirname "$0")/../.."
export TCACHE_MAX_MB=0
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage tl 120 python bench/flash_bench.py --layers 4 --prefill "" --decode-batches 64,16 \
    --ctx 8192 --steps 2 --budget 100 --timeline "$LOGS/tl.txt" --out "$LOGS/tl.json"
grep -h "decode B" "$LOGS/tl.log"
grep -h -A30 "by kernel" "$LOGS/tl.txt" | head -80
