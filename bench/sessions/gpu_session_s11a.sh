#!/usr/bin/env bash
# Next session, first call: the joined up kernel of the predecoded FP8-MMA experts
# (dsv4/ops/triton_moe_fp8.py: w1 and w3 re-encoded into one buffer, one dot a K step;
# written without a GPU, off: JOIN_UP, DSV4_FP8MMA_JOIN=1).  One device call (~300 s).
#   1. t_fp8: the FP8-MMA GPU tests (the joined kernel against the two-dot one and the twin);
#   2. moe: bench/moe_prefill_fp8.py at 8K / 32K with the sweep (the joined plans too);
#   3. pf_join: 4 V4-Flash layers, 32K prefill with the joined kernel (16K+ steps take the
#      FP8-MMA path by default), against the same without it.
# If t_fp8 passes and the joined rows are faster: JOIN_UP on by default (the fastest joined
# plan as PLAN_JOINED), and MIN_PAIRS_PER_EXPERT re-chosen from the new crossover.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage t_fp8 90 python -m pytest -q -s -p no:cacheprovider tests/kernels/test_moe_fp8mma_gpu.py
stage moe 120 python bench/moe_prefill_fp8.py --tokens 8192,32768 --sweep --out "$LOGS/moe.json"
stage pf_two 60 python bench/flash_bench.py --layers 4 --prefill 16384,32768 --decode-batches "" \
    --reps 3 --budget 50 --out "$LOGS/pf_two.json"
stage pf_join 60 env DSV4_FP8MMA_JOIN=1 python bench/flash_bench.py --layers 4 \
    --prefill 16384,32768 --decode-batches "" --reps 3 --budget 50 --out "$LOGS/pf_join.json"
grep -h "prefill S" "$LOGS"/pf_two.log "$LOGS"/pf_join.log
