#!/usr/bin/env bash
# For the thirty-third session: the routed w2 GEMM without PDL (gluon_moe_decode.DOWN_PDL, new:
# the shared expert's w2 then gets the slots the parked w2 programs held during the up GEMM) —
# its GPU test, the 4-layer B=1 A/B (interleaved graph replays) and a timeline with it; then
# 43 layers at B=1 with the new routing (the target, last measured before it went in).
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
precompile_stage 120
stage tests 90 python -m pytest -q -rf tests/kernels/test_moe_wgmma_gpu.py -k "down_without or decode_with_shared"
grep -h "passed\|failed\|FAILED\|Error\|assert" "$LOGS/tests.log" | head -10
stage ab 150 python bench/flash_bench.py --layers 4 --prefill "" --decode-batches 1 \
    --ctx 8192 --steps 2 --launch-ab --ab-variants "pdl;pdl, wgmma w2 without PDL"
grep -h "decode B=1" "$LOGS/ab.log" | head -3
DSV4_MOE_WGMMA_DOWN_PDL=0 stage tl 90 python bench/flash_bench.py --layers 4 --prefill "" \
    --decode-batches 1 --ctx 8192 --steps 2 --timeline "$LOGS/tl.txt"
cp "$LOGS/tl.txt" "$OUT/tl_down_plain.txt"
stage b1_43 200 python bench/flash_bench.py --layers 43 --experts $EXPERTS --prefill "" \
    --decode-batches 1 --ctx 8192 --steps 2 --launch-ab --ab-variants "pdl;pdl, wgmma w2 without PDL"
grep -h "decode B=1\|model built" "$LOGS/b1_43.log" | tail -n 3
