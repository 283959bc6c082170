#!/usr/bin/env bash
# Eleventh session, last short call: what the in-register MXFP4 decode costs the decode expert
# kernels — bench/moe_decode_nodecode.py (the decode stripped to a byte permute, same loads and
# MMAs; garbage values) against the real kernels, 1 / 16 / 64 tokens, separate processes.
# Written at the end of the eleventh session, not run yet (the device budget was spent).
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage stripped 60 python bench/moe_decode_nodecode.py --tokens 1,16,64
stage real 60 python bench/moe_decode.py --tokens 1,16,64
grep -h "^| [0-9]" "$LOGS"/stripped.log "$LOGS"/real.log
