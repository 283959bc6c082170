#!/usr/bin/env bash
# Thirty-third session: 43 layers at B=1 with the new routing (the target, last measured before
# it went in), the routed w2 GEMM with PDL (default) and without (DOWN_PDL) interleaved.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
precompile_stage 90
stage b1_43 240 python bench/flash_bench.py --layers 43 --experts $EXPERTS --prefill "" \
    --decode-batches 1 --ctx 8192 --steps 2 --launch-ab --ab-variants "pdl;pdl, wgmma w2 without PDL"
grep -h "decode B=1\|model built" "$LOGS/b1_43.log" | tail -n 3
