#!/usr/bin/env bash
# Ninth session, first look: the wo_a GEMV in the model (GPU test), the B=1 decode timeline with
# and without PDL (4 layers), and Nsight Compute over one eager B=1 step (every kernel alone).
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage t_model 90 python -m pytest -q -p no:cacheprovider tests/model/test_side_stream_gpu.py
stage tl_pdl 120 python bench/flash_bench.py --layers 4 --prefill "" --decode-batches 1 \
    --ctx 8192 --steps 2 --budget 100 --timeline "$LOGS/tl_pdl.txt" --out "$LOGS/tl_pdl.json"
stage tl_plain 120 env DSV4_PDL=0 python bench/flash_bench.py --layers 4 --prefill "" \
    --decode-batches 1 --ctx 8192 --steps 2 --budget 100 --timeline "$LOGS/tl_plain.txt"
stage ncu 200 env DSV4_PDL=0 ncu --nvtx --nvtx-include "step/" --csv --page raw \
    --section SpeedOfLight --section WarpStateStats --section LaunchStats --section Occupancy \
    --metrics dram__bytes_read.sum,dram__bytes_write.sum,smsp__inst_executed.sum \
    python bench/ncu_step.py --layers 4 --batch 1 --ctx 4096
grep -h "decode B" "$LOGS"/tl_*.log | tail -n 2
