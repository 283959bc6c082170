#!/usr/bin/env bash
# Fortieth session (~570 s): on an H200 first the 43-layer targets (8K prefill, B=1, B=64 at an
# 8K context; not re-measured there since the thirty-first session); on any GPU Nsight Compute
# on the 8K prefill's mHC post + mixes and q norm + RoPE launches (bench/ncu_glue.py), the post
# + mixes plans at 8K (H100 only), then s40a's DSV4_HW_BF16_ROUND premise and 4-layer A/B.
set -u
cd "$(dirname "$0")/../.."
export TCACHE_MAX_MB=0
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
echo "$gpu"
reps=2
case "$gpu" in
    *H200*)
        reps=1
        stage full43 240 python bench/flash_bench.py --layers 43 --experts $EXPERTS --prefill 8192 \
            --decode-batches 1,64 --ctx 8192 --steps 2 --reps 2 --budget 220 --out "$LOGS/full43.json"
        grep -h "prefill S\|decode B\|model built" "$LOGS/full43.log" | tail -n 12 ;;
esac
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
stage ncu 90 "$NCU" --clock-control none -k 'regex:_hc_post_mix|_norm_rope' --launch-skip 4 \
    --launch-count 2 --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
    --section Occupancy --section LaunchStats --section SourceCounters python bench/ncu_glue.py
grep -h "Duration\|Memory Throughput\|DRAM Throughput\|Registers\|Achieved Occupancy\|Stall\|stall" \
    "$LOGS/ncu.log" | head -n 40
if [ $reps = 2 ]; then
    stage sweep 100 python bench/sweep_glue.py --ops hc_post_pre --tokens 8192 --budget 90
    grep -h "^|" "$LOGS/sweep.log" | head -n 24
fi
stage premise 60 python -m pytest -q tests/kernels/test_gpu_kernels.py -k bf16_cast
for i in $(seq $reps); do
    for v in 0 1; do
        DSV4_HW_BF16_ROUND=$v stage "p4_${v}_$i" 90 python bench/flash_bench.py --layers 4 \
            --prefill 8192 --decode-batches 1,64 --ctx 8192 --steps 2 --reps 3
        grep -h "prefill S=\|graph" "$LOGS/p4_${v}_$i.log" | tail -n 3
    done
done
