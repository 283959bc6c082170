#!/usr/bin/env bash
# Tenth session, second call: the predecoded FP8-MMA experts for prefill (dsv4/ops/
# triton_moe_fp8.py: each chunk of MXFP4 experts re-encoded losslessly to e4m3 codes and step
# factors by _fp8_predecode_kernel, then the FP8 GEMMs stream those; written without a GPU;
# off in the engine: FP8MMA_PREFILL, DSV4_FP8MMA=1 turns it on).  One device call (~500 s).
#   1. t_fp8: the FP8-MMA GPU tests (predecoded vs in-loop decode vs twin, the op-table route,
#      the old in-loop tests now on the predecoded default);
#   2. moe: bench/moe_prefill_fp8.py at 2K / 8K / 32K tokens, every sweep plan, both weight
#      modes, and the re-encoding alone;
#   3. pf_bf16 / pf_fp8: 4 V4-Flash layers, 8K and 32K prefill, the bf16-MMA experts vs the
#      predecoded FP8-MMA experts (DSV4_FP8MMA=1).
# If t_fp8 passes and pf_fp8 is faster: FP8MMA_PREFILL on by default (MIN_PAIRS_PER_EXPERT
# from the moe table's crossover).
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage t_fp8 120 python -m pytest -q -s -p no:cacheprovider tests/kernels/test_moe_fp8mma_gpu.py
stage moe 150 python bench/moe_prefill_fp8.py --tokens 2048,8192,32768 --sweep \
    --out "$LOGS/moe.json"
stage pf_bf16 90 python bench/flash_bench.py --layers 4 --prefill 8192,32768 --decode-batches "" \
    --reps 3 --budget 80 --out "$LOGS/pf_bf16.json"
stage pf_fp8 90 env DSV4_FP8MMA=1 python bench/flash_bench.py --layers 4 --prefill 8192,32768 \
    --decode-batches "" --reps 3 --budget 80 --out "$LOGS/pf_fp8.json"
grep -h "prefill" "$LOGS"/pf_bf16.log | tail -n 3
grep -h "prefill" "$LOGS"/pf_fp8.log | tail -n 3
