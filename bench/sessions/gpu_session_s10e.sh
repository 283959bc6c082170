#!/usr/bin/env bash
# Tenth session, last call: the predecoded FP8-MMA experts with the re-encoding on its own
# stream next to the GEMMs (two scratch slots) and the 32 x 8 re-encoding tile, then the final
# 4-layer table.  One device call (~450 s of stage limits).
#   1. t_fp8: the FP8-MMA GPU tests (overlapped vs in-order re-encoding: the same bits);
#   2. moe: bench/moe_prefill_fp8.py at 4K / 8K / 32K (picked plans, both weight modes);
#   3. final: 4 V4-Flash layers, 4K / 8K / 32K prefill, decode B 1 / 16 / 64 with the launch
#      variants (the engine's defaults: bf16-MMA prefill experts, the fused ape add);
#   4. pf_fp8: the same prefills with the predecoded FP8-MMA experts (DSV4_FP8MMA=1).
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage t_fp8 70 python -m pytest -q -s -p no:cacheprovider tests/kernels/test_moe_fp8mma_gpu.py
stage moe 60 python bench/moe_prefill_fp8.py --tokens 4096,8192,32768 --out "$LOGS/moe.json"
stage final 230 python bench/flash_bench.py --layers 4 --prefill 4096,8192,32768 \
    --decode-batches 1,16,64 --ctx 8192 --steps 2 --reps 2 --launch-ab --budget 215 \
    --out "$LOGS/final.json"
stage pf_fp8 90 env DSV4_FP8MMA=1 python bench/flash_bench.py --layers 4 \
    --prefill 4096,8192,32768 --decode-batches "" --reps 3 --budget 80 --out "$LOGS/pf_fp8.json"
grep -h "prefill S\|decode B" "$LOGS"/final.log | tail -n 6
grep -h "prefill S" "$LOGS"/pf_fp8.log | tail -n 3
