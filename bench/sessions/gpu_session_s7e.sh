#!/usr/bin/env bash
# Seventh session, plan sweeps at decode sizes (< 4 min on two H200s): mHC post+mix / pre at
# T = 1/16/64 and the routed experts at 1-2 tokens on GPU 0, the FP8 GEMV candidates at 1-2 rows
# on GPU 1.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
(CUDA_VISIBLE_DEVICES=1 stage gemv_sweep 180 python bench/fp8_decode_sweep.py --gemv --sweep \
    --rows 1,2 --out "$LOGS/gemv_sweep.json") &
export CUDA_VISIBLE_DEVICES=0
stage hc_sweep 90 python bench/sweep_glue.py --ops hc_post_pre,hc_pre --tokens 1,16,64 \
    --budget 70 --out "$LOGS/hc_sweep.json"
stage moe_sweep 80 python bench/moe_decode.py --tokens 1,2 --sweep --out "$LOGS/moe_sweep.json"
wait
tar -czf "$OUT/session.tar.gz" -C "$LOGS" .
