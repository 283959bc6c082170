#!/usr/bin/env bash
# Eleventh session, second call: the routed experts' e4m3-coded activations at decode
# (dsv4/ops/triton_moe.py ACT_CODES, on by default for the decode plans under official
# numerics; written without a GPU).  One device call (~420 s).
# Ran once against 23e52ee; the coded path was then reverted (not faster: docs/PERFORMANCE.md,
# eleventh session).  Kept as the record of that run.
#   1. t_moe: the expert GPU tests (the codes path against the values path, the twin, the ALU
#      decode, fp32 activations; every default-plan test now takes it);
#   2. t_model: the model's side-stream / lane bits tests and the engine's graph tests;
#   3. moe_vals / moe_codes: bench/moe_decode.py at 1-64 tokens, values vs codes;
#   4. dec: 4 V4-Flash layers, decode B 1 / 16 / 64 with the launch variants (one of them the
#      values activations, interleaved in the same process).
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage t_moe 170 python -m pytest -q -x -p no:cacheprovider tests/kernels/test_moe_fast.py \
    tests/kernels/test_fp4_asm.py
stage moe_vals 50 env DSV4_MOE_ACT_CODES=0 python bench/moe_decode.py --tokens 1,2,16,64 \
    --out "$LOGS/moe_vals.json"
stage moe_codes 50 python bench/moe_decode.py --tokens 1,2,16,64 --out "$LOGS/moe_codes.json"
stage dec 190 python bench/flash_bench.py --layers 4 --prefill "" --decode-batches 1,16,64 \
    --ctx 8192 --steps 2 --reps 2 --launch-ab --budget 175 --out "$LOGS/dec.json"
stage t_model 100 python -m pytest -q -x -p no:cacheprovider tests/model/test_side_stream_gpu.py \
    tests/engine/test_cuda_graphs_gpu.py
grep -h "moe B\|decode B" "$LOGS"/dec.log | tail -n 6
tail -n 12 "$LOGS"/moe_vals.log "$LOGS"/moe_codes.log
