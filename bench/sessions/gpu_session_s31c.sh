#!/usr/bin/env bash
# Thirty-first session's fourth call: where the gate launch's ~11 µs go (bench/gate_parts.py,
# PDL on and off), and the staged wgmma weights against the default at 43 layers, B=1, twice
# (both orders of the interleaved replays).
set -u
cd "$(dirname "$0")/../.."
export TCACHE_MAX_MB=0
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage gate 90 python bench/gate_parts.py --tokens 1,2,4
grep -h "^|\|PDL" "$LOGS/gate.log"
stage gate0 60 env DSV4_PDL=0 python bench/gate_parts.py --tokens 1,2
grep -h "^|\|PDL" "$LOGS/gate0.log"
stage st1 110 python bench/flash_bench.py --layers 43 --experts $EXPERTS --prefill "" \
    --decode-batches 1 --ctx 8192 --steps 2 --launch-ab \
    --ab-variants "pdl, wgmma weights staged (4);pdl;pdl, wgmma weights before the fill"
grep -h "decode B=" "$LOGS/st1.log" | head -1
stage st2 110 python bench/flash_bench.py --layers 43 --experts $EXPERTS --prefill "" \
    --decode-batches 1 --ctx 8192 --steps 2 --launch-ab \
    --ab-variants "pdl;pdl, wgmma weights staged (4)"
grep -h "decode B=" "$LOGS/st2.log" | head -1
