#!/usr/bin/env bash
# Fortieth session (~590 s): the GPU bit tests of the mHC plans (gates once, fn split ahead) and
# of the chunked routing plan; bench/prefill_glue.py (the plan's time); the post + mixes / mixes
# plans at 1 and 8K tokens; the 4-layer prefill / decode A/B of DSV4_HC_FN_PARTS (and on an
# H100 of DSV4_HW_BF16_ROUND, then Nsight Compute on the 8K post + mixes and q norm + RoPE
# launches); on an H200 last the 43-layer targets (8K prefill, B=1, B=64 at an 8K context; not
# re-measured there since the thirty-first session).
set -u
cd "$(dirname "$0")/../.."
export TCACHE_MAX_MB=0
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
echo "$gpu"
h200=0
case "$gpu" in *H200*) h200=1 ;; esac
stage tests 80 python -m pytest -q tests/kernels/test_hc_fused.py tests/kernels/test_gpu_kernels.py \
    tests/kernels/test_moe_fast.py -k "parts or gates or bf16_cast or plan"
tail -n 3 "$LOGS/tests.log"
stage glue 40 python bench/prefill_glue.py --tokens 2048,8192,32768
grep -h "^|" "$LOGS/glue.log"
stage sweep 90 python bench/sweep_glue.py --ops hc_post_pre,hc_pre --tokens 1,8192 --budget 75
grep -h "^|" "$LOGS/sweep.log" | head -n 40
variants="00 10"
[ $h200 = 0 ] && variants="00 10 01"
for v in $variants; do
    DSV4_HC_FN_PARTS=${v:0:1} DSV4_HW_BF16_ROUND=${v:1:1} stage "p4_$v" 80 python \
        bench/flash_bench.py --layers 4 --prefill 8192 --decode-batches 1,64 --ctx 8192 \
        --steps 2 --reps 3
    grep -h "prefill S=\|graph" "$LOGS/p4_$v.log" | tail -n 3
done
if [ $h200 = 1 ]; then
    stage full43 230 python bench/flash_bench.py --layers 43 --experts $EXPERTS --prefill 8192 \
        --decode-batches 1,64 --ctx 8192 --steps 2 --reps 2 --budget 210 --out "$LOGS/full43.json"
    grep -h "prefill S\|decode B\|model built" "$LOGS/full43.log" | tail -n 12
else
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
    stage ncu 80 "$NCU" --clock-control none -k 'regex:_hc_post_mix|_norm_rope' --launch-skip 4 \
        --launch-count 2 --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section WarpStateStats --section SchedulerStats --section Occupancy \
        --section LaunchStats python bench/ncu_glue.py
    grep -h "Duration\|DRAM Throughput\|Registers Per\|Achieved Occupancy\|Warp Cycles Per Issued\|Block Limit" \
        "$LOGS/ncu.log" | head -n 30
fi
