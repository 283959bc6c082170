#!/usr/bin/env bash
# Written in the eighteenth session, not run (no device time left): the in-step A/B of the three
# plan switches that are off until measured — the one-row FP8 GEMV plans without split-K
# (DSV4_FP8_GEMV_WIDE), the bf16-weight GEMM's wider one-row plans (DSV4_LINEAR32_WIDE), the
# attention's decode split floor (DSV4_ATTN_SPLIT_MIN_ROWS) — 4 layers at B 1 / 2, interleaved
# graph replays, each variant's logits against the plain launch's (~3 min).
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage ab 240 python bench/flash_bench.py --layers 4 --prefill "" --decode-batches 1,2 \
    --ctx 8192 --steps 2 --budget 220 --launch-ab \
    --ab-variants "pdl;pdl, wide one-row GEMV plans;pdl, wide one-row bf16w plans;pdl, unsplit short attention" \
    --out "$LOGS/ab.json"
grep -h "decode B\|Error" "$LOGS"/*.log | tail -n 20
