#!/usr/bin/env bash
# Eleventh session, a last short call: the warp-stall breakdown of the decode expert kernels at
# one and at 64 tokens (run s11c gave occupancy and issue rate, not the stall reasons), so the
# next kernel for them can be designed against the measured bound.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
for T in 1 64; do
    stage "ncu_t$T" 70 env DSV4_PDL=0 ncu --clock-control none -k regex:"_moe_up|_moe_down" \
        --launch-skip 2 --launch-count 2 --section WarpStateStats --section SchedulerStats \
        --metrics regex:"smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
        python bench/ncu_probe.py "$T"
done
grep -h "_moe_\|stalled\|Issued Warp\|No Eligible\|Eligible Warps\|Active Warps" "$LOGS"/ncu_t*.log \
    | grep -v "^==" | head -n 120
