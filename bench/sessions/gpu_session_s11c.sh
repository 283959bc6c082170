#!/usr/bin/env bash
# Eleventh session, third call: the tree after the e4m3-coded expert activations were reverted
# (the experts' GPU tests again, bits of every launch variant), an Nsight Compute look at the
# decode expert kernels at one token (why 24% fewer instructions gained nothing: occupancy and
# warp stalls), and transformers on the same 4-layer workload (issue #5's >= 50x target).
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage t_moe 150 python -m pytest -q -x -p no:cacheprovider tests/kernels/test_moe_fast.py \
    tests/kernels/test_fp4_asm.py
stage ncu 120 env DSV4_PDL=0 ncu --clock-control none -k regex:"_moe_up|_moe_down" \
    --launch-skip 2 --launch-count 2 --section SpeedOfLight --section Occupancy \
    --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \
    python bench/ncu_probe.py 1
stage dec 90 python bench/flash_bench.py --layers 4 --prefill "" --decode-batches 16,64 \
    --ctx 8192 --steps 2 --reps 2 --launch-ab --budget 80 --out "$LOGS/dec.json"
stage hf 170 python bench/flash_bench.py --layers 4 --prefill 4096 --decode-batches 1 \
    --ctx 4096 --steps 3 --budget 60 --launch-ab --hf "4096;1:4096" --out "$LOGS/hf.json"
grep -h "decode B\|prefill S\|transformers\|hf " "$LOGS"/dec.log "$LOGS"/hf.log | grep -v "moe B" | tail -n 8
grep -h -i "occupancy\|registers\|stall\|issue slot\|Duration\|DRAM Through\|Block Limit\|Shared Memory Config" \
    "$LOGS"/ncu.log | head -n 60
