#!/usr/bin/env bash
# Fifteenth session, first call (~6 min): where the B=1 step goes now (the 4-layer graph's kernel
# timeline with both lane placements on) and transformers on the same workload (issue #5's 50x
# target: B=1 at a 4K context, B=16 at a 1K context).
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage dec 150 python bench/flash_bench.py --layers 4 --prefill "" --decode-batches 1 \
    --ctx 8192 --steps 2 --budget 130 --timeline "$LOGS/tl.txt" --out "$LOGS/dec.json"
stage hf 220 python bench/flash_bench.py --layers 4 --prefill 4096 --decode-batches 1,16 \
    --ctx 4096 --steps 3 --budget 100 --hf "4096;1:4096,16:1024" --out "$LOGS/hf.json"
grep -h "decode B" "$LOGS"/dec.log
grep -h "prefill S\|decode B\|transformers\|hf " "$LOGS"/hf.log | grep -v "moe B" | tail -n 12
