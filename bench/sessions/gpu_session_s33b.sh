#!/usr/bin/env bash
# Thirty-third session, first call: the prefill expert GEMMs walking each row block's N tiles
# first (triton_moe.N_FIRST, new): its GPU bits test and bench/moe_order.py at 2K / 8K tokens
# (256 experts); the routed w2 GEMM without PDL (gluon_moe_decode.DOWN_PDL): its GPU test and
# the 4-layer B=1 A/B (interleaved graph replays).
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage tests 150 python -m pytest -q -rf tests/kernels/test_moe_fp8mma_gpu.py \
    tests/kernels/test_moe_wgmma_gpu.py -k "n_tiles_first or down_without or decode_with_shared"
grep -h "passed\|failed\|FAILED\|Error\|assert" "$LOGS/tests.log" | head -10
stage order 150 python bench/moe_order.py --tokens 2048,8192 --out "$OUT/order.json"
grep -h "^|" "$LOGS/order.log"
precompile_stage 90
stage ab 150 python bench/flash_bench.py --layers 4 --prefill "" --decode-batches 1 \
    --ctx 8192 --steps 2 --launch-ab --ab-variants "pdl;pdl, wgmma w2 without PDL"
grep -h "decode B=1" "$LOGS/ab.log" | head -3
