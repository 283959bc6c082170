#!/usr/bin/env bash
# Nineteenth session: does PDL pay past PDL_MAX_TOKENS (16) at the current code?  (The eighth
# session measured B=64 3.2% slower with it; the steps have far fewer launches since.)  4 layers,
# interleaved graph replays at B 16 / 32 / 64 / 256, plain vs PDL vs PDL at any size (~3 min).
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage ab 300 python bench/flash_bench.py --layers 4 --prefill "" --decode-batches 64,32,16,256 \
    --ctx 8192 --steps 2 --budget 280 --launch-ab --ab-variants "pdl;pdl at any size" \
    --out "$LOGS/ab.json"
grep -h "decode B\|Error" "$LOGS"/ab.log | tail -n 8
