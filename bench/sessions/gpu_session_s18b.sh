#!/usr/bin/env bash
# Eighteenth session, second call (~7 min): the swapped-operand FP8 tensor-core kernel for 1-16
# rows (dsv4/ops/triton_fp8_swap.py): its GPU tests, bench/fp8_decode_sweep.py --swap against
# the GEMV and MMA plans (default plans at 1-16 rows, the plan sweep at 1 and 16), then 4 layers
# at B 1 / 2 / 16 with it on (DSV4_FP8_SWAP_MAX_M=16) and off.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage gputests 150 python -m pytest -q tests/kernels/test_fp8_swap.py -k gpu
stage swap 120 python bench/fp8_decode_sweep.py --swap --rows 1,2,4,8,16 --out "$LOGS/swap.json"
stage sweep 170 python bench/fp8_decode_sweep.py --swap --sweep --rows 1,16 \
    --out "$LOGS/sweep.json"
stage off 90 python bench/flash_bench.py --layers 4 --prefill "" --decode-batches 1,2,16 \
    --ctx 8192 --steps 2 --budget 75 --out "$LOGS/off.json"
DSV4_FP8_SWAP_MAX_M=16 stage on 90 python bench/flash_bench.py --layers 4 --prefill "" \
    --decode-batches 1,2,16 --ctx 8192 --steps 2 --budget 75 --out "$LOGS/on.json"
grep -h "decode B\|passed\|failed\|swap\|gemv" "$LOGS"/*.log | tail -n 70
