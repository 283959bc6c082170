#!/usr/bin/env bash
# Tenth session, fourth call: the FP8-MMA prep kernel's contiguous store (run C's profile: 2.2 ms
# per 8K-token call, scattered single-byte stores), the predecoded plan and re-encoding tiles.
# One device call (~240 s of stages).
#   1. t_fp8: the FP8-MMA GPU tests (also every re-encoding tile against the default);
#   2. moe: bench/moe_prefill_fp8.py at 8K / 32K, sweep plans and re-encoding tiles;
#   3. pf_fp8: 4 V4-Flash layers, 8K / 32K prefill with the predecoded FP8-MMA experts
#      (DSV4_FP8MMA=1), and a torch.profiler table of the 8K prefill.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage t_fp8 90 python -m pytest -q -s -p no:cacheprovider tests/kernels/test_moe_fp8mma_gpu.py
stage moe 90 python bench/moe_prefill_fp8.py --tokens 8192,32768 --sweep --out "$LOGS/moe.json"
stage pf_fp8 100 env DSV4_FP8MMA=1 python bench/flash_bench.py --layers 4 --prefill 8192,32768 \
    --decode-batches "" --reps 3 --budget 90 --profile "$LOGS/profile.txt" \
    --out "$LOGS/pf_fp8.json"
grep -h "prefill S" "$LOGS"/pf_fp8.log | tail -n 2
