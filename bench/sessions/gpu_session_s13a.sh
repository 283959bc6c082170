#!/usr/bin/env bash
# Written at the end of the twelfth session (its device time was spent), for the next one's
# first call (~8 min): the K-step unit path of the routed experts at one / two tokens
# (dsv4.ops.triton_moe_units, off by default: DSV4_MOE_UNITS=1), and the one-launch decode
# plan + prep (moe_plan_prep, GPU-tested in s12g but not yet timed in the 4-layer step), and
# the picked_rows kernel (dsv4.ops.UNVERIFIED_ON_GPU until its GPU test has run).
#   1. the unit path's and picked_rows' GPU tests;
#   2. the expert op at 1 / 2 tokens: the split-K default against units at 2..8 per SM;
#   3. 4 layers, decode B 1 / 2: the default, then with DSV4_MOE_UNITS=1.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage tests 150 python -m pytest -q -x tests/kernels/test_moe_units_gpu.py \
    tests/kernels/test_picked_rows.py
stage units 90 python bench/moe_decode_layout.py --tokens 1,2 --units 2,3,4,6,8 \
    --out "$LOGS/units.json"
stage base 150 python bench/flash_bench.py --layers 4 --prefill "" --decode-batches 1,2 \
    --ctx 8192 --steps 2 --budget 140 --out "$LOGS/base.json"
stage unitsdec 150 env DSV4_MOE_UNITS=1 python bench/flash_bench.py --layers 4 --prefill "" \
    --decode-batches 1,2 --ctx 8192 --steps 2 --budget 140 --out "$LOGS/unitsdec.json"
grep -h "^| [0-9]" "$LOGS"/units.log
grep -h "decode B\|moe B" "$LOGS"/base.log "$LOGS"/unitsdec.log
tail -n 3 "$LOGS"/tests.log
