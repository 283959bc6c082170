#!/usr/bin/env bash
# Eighteenth session, first call (~5 min): where the decode step and the 8K prefill go now.
# The 4-layer B=1 graph timeline as run (PDL, lanes) and fully serial (plain launches, one
# stream: each kernel's own duration, in order), then a torch.profiler table of the 8K prefill.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage tl_pdl 120 python bench/flash_bench.py --layers 4 --prefill "" --decode-batches 1 \
    --ctx 8192 --steps 2 --budget 100 --timeline "$LOGS/tl_pdl.txt" --out "$LOGS/tl_pdl.json"
DSV4_PDL=0 DSV4_SIDE_STREAM=0 stage tl_serial 120 python bench/flash_bench.py --layers 4 \
    --prefill "" --decode-batches 1 --ctx 8192 --steps 2 --budget 100 \
    --timeline "$LOGS/tl_serial.txt" --out "$LOGS/tl_serial.json"
stage prof 150 python bench/flash_bench.py --layers 4 --prefill 8192 --decode-batches "" \
    --reps 2 --budget 130 --profile "$LOGS/prof.txt" --out "$LOGS/prof.json"
grep -h "decode B\|prefill\|span" "$LOGS"/*.log | tail -n 30
