#!/usr/bin/env bash
# Eleventh session, last call: occupancy of the decode expert kernels (Nsight Compute, run
# s11c: 126 registers a thread hold an SM to 4 programs, 25%; one token's 768 programs run in
# 1.45 waves).  bench/moe_decode.py --occupancy times register caps (MoeConfig.maxnreg_*: 96 ->
# 5 programs an SM, 80 -> 6) and whole-wave K splits at 1 / 16 / 64 tokens, each plan checked
# against the twin and for finite outputs; then the expert GPU tests' sweep (every plan).
# Ran once against ed81ccf; the caps and the wave splits were then removed (slower at every
# token count: docs/PERFORMANCE.md, eleventh session).  Kept as the record of that run.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage occ 240 python bench/moe_decode.py --occupancy --tokens 1,2,16,64 --out "$LOGS/occ.json"
stage t_sweep 200 python -m pytest -q -x -p no:cacheprovider tests/kernels/test_moe_fast.py \
    -k "sweep_plans_gpu and (1-1 or 16-16 or 64-64)"
cat "$LOGS"/occ.log | grep "^|" | head -n 40
