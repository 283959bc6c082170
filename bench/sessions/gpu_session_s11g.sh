#!/usr/bin/env bash
# First call of the next session (written at the end of the eleventh, not run yet: its device
# budget was spent).  ~5 minutes:
#   1. stripped / real: what the in-register MXFP4 decode costs the decode expert kernels —
#      bench/moe_decode_nodecode.py (the decode stripped to a byte permute, same loads and MMAs;
#      garbage values) against the real kernels at 1 / 16 / 64 tokens, separate processes;
#   2. sweep1: the full decode-plan sweep at one token on this machine (a fresh baseline);
#   3. tl: the 4-layer B=1 kernel timeline with PDL (the last one is the ninth session's).
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage stripped 60 python bench/moe_decode_nodecode.py --tokens 1,16,64
stage real 60 python bench/moe_decode.py --tokens 1,16,64
stage sweep1 90 python bench/moe_decode.py --tokens 1 --sweep --out "$LOGS/sweep1.json"
stage tl 100 python bench/flash_bench.py --layers 4 --prefill "" --decode-batches 1 \
    --ctx 8192 --steps 2 --budget 90 --timeline "$LOGS/tl_pdl.txt" --out "$LOGS/tl_pdl.json"
grep -h "^| [0-9]" "$LOGS"/stripped.log "$LOGS"/real.log
head -n 45 "$LOGS"/tl_pdl.txt
