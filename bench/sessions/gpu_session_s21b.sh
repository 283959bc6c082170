#!/usr/bin/env bash
# Twenty-first session, run B: the 4-layer prefill (2K / 8K tokens) with the token-tile indexer
# kernel (the default from 256 tokens) and without it (DSV4_INDEXER_TILE_MIN_T=0: the one-token
# kernel), then the eighteenth session's in-step A/B of the three decode plan switches left off
# (gpu_session_s18g.sh, never run).
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage pre_tile 110 python bench/flash_bench.py --layers 4 --prefill 2048,8192 \
    --decode-batches "" --reps 3 --budget 90 --out "$LOGS/pre_tile.json"
DSV4_INDEXER_TILE_MIN_T=0 stage pre_one 110 python bench/flash_bench.py --layers 4 \
    --prefill 2048,8192 --decode-batches "" --reps 3 --budget 90 --out "$LOGS/pre_one.json"
for p in tile one; do echo "prefill indexer=$p"; grep -h "prefill S=\|Error" "$LOGS/pre_$p.log" | tail -n 3; done
stage ab 200 python bench/flash_bench.py --layers 4 --prefill "" --decode-batches 1,2 \
    --ctx 8192 --steps 2 --budget 170 --launch-ab \
    --ab-variants "pdl;pdl, wide one-row GEMV plans;pdl, wide one-row bf16w plans;pdl, unsplit short attention" \
    --out "$LOGS/ab.json"
grep -h "decode B\|Error\|median\|variant\|bits" "$LOGS"/ab.log | tail -n 30
