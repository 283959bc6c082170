#!/usr/bin/env bash
# Tenth session, third call: the predecoded FP8-MMA experts with their codes typed e4m3 (run B
# loaded them as bytes and bitcast them, which made Triton stage them through registers: no
# direct shared-memory copy for the MMA operand).  One device call (~250 s of stages).
#   1. t_fp8: the FP8-MMA GPU tests;
#   2. moe: bench/moe_prefill_fp8.py at 8K / 32K, every sweep plan, both weight modes;
#   3. pf_fp8: 4 V4-Flash layers, 8K and 32K prefill with DSV4_FP8MMA=1, then a torch.profiler
#      table of the 8K prefill (where the rest of the prefill goes).
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage t_fp8 90 python -m pytest -q -s -p no:cacheprovider tests/kernels/test_moe_fp8mma_gpu.py
stage moe 90 python bench/moe_prefill_fp8.py --tokens 8192,32768 --sweep --out "$LOGS/moe.json"
stage pf_fp8 120 env DSV4_FP8MMA=1 python bench/flash_bench.py --layers 4 --prefill 8192,32768 \
    --decode-batches "" --reps 3 --budget 100 --profile "$LOGS/profile.txt" \
    --out "$LOGS/pf_fp8.json"
grep -h "prefill" "$LOGS"/pf_fp8.log | tail -n 3
