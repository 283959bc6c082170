#!/usr/bin/env bash
# Ninth session: where the comb lane's time went — the B=1 4-layer timeline (plain launches)
# with the comb lane on and off.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage tl_lane 100 env DSV4_PDL=0 python bench/flash_bench.py --layers 4 --prefill "" \
    --decode-batches 1 --ctx 8192 --steps 2 --budget 90 --timeline "$LOGS/tl_lane.txt"
stage tl_nolane 100 env DSV4_PDL=0 DSV4_COMB_LANE=0 python bench/flash_bench.py --layers 4 \
    --prefill "" --decode-batches 1 --ctx 8192 --steps 2 --budget 90 \
    --timeline "$LOGS/tl_nolane.txt"
grep -h "decode B" "$LOGS"/tl_*.log | tail -n 2
