#!/usr/bin/env bash
# Eighteenth session, fifth call (~4 min): the new one-row GEMV plans against the former ones
# in one process (interleaved graph replays, 4 layers, B=1), then the bf16-weight fp32 GEMM
# (the MoE gate, the compressors) swept over more warps and longer K chunks at one row.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage ab 150 python bench/flash_bench.py --layers 4 --prefill "" --decode-batches 1 \
    --ctx 8192 --steps 2 --budget 130 --launch-ab \
    --ab-variants "pdl;pdl, former one-row GEMV plans" --out "$LOGS/ab.json"
stage bf16w 150 python bench/kernels.py --only linear_bf16w --sweep --wide \
    --out "$LOGS/bf16w.json"
grep -h "decode B\|launch\|pdl\|plain\|linear_bf16w\|sweep" "$LOGS"/*.log | tail -n 40
