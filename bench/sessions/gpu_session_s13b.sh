#!/usr/bin/env bash
# Thirteenth session, second call (~7 min): where the time goes now, on the default path —
# a torch.profiler table of the 4-layer 8K prefill (and eager decode B 1 / 64), and the kernel
# timeline of the B=1 decode graph.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage pf 230 python bench/flash_bench.py --layers 4 --prefill 8192 --decode-batches "" \
    --ctx 8192 --reps 2 --budget 200 --profile "$LOGS/profile.txt" --out "$LOGS/pf.json"
stage dec 160 python bench/flash_bench.py --layers 4 --prefill "" --decode-batches 1 \
    --ctx 8192 --steps 2 --budget 140 --timeline "$LOGS/tl.txt" --out "$LOGS/dec.json"
grep -h "prefill\|decode B" "$LOGS"/pf.log "$LOGS"/dec.log | tail -n 4
head -n 45 "$LOGS"/tl.txt
