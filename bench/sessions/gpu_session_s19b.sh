#!/usr/bin/env bash
# Ran in the nineteenth session (docs/PERFORMANCE.md); bench/ws_gemm.py and the TMA /
# warp-specialized expert kernels were removed after it: they are at commit 7c14f5f.
# Nineteenth session: the prefill experts' GEMMs through TMA descriptors, plain and with
# Hopper's automatic warp specialization (DSV4_FP8MMA_LOADS tma / ws).  GPU bits test against
# the pointer-load kernels, bench/ws_gemm.py (the model's kernels, V4-Flash widths, an 8K
# prefill's routing, a child process per row), then the whole FP8-MMA expert path at 8K tokens
# under each loads setting (~8.5 min).
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage tests 120 python -m pytest -q -x tests/kernels/test_moe_fp8mma_gpu.py -k tma_tiles
stage ws 230 python bench/ws_gemm.py --timeout 40
for loads in ptr tma ws; do
    DSV4_FP8MMA_LOADS=$loads stage "path_$loads" 60 python bench/moe_prefill_fp8.py --tokens 8192
done
tail -n 3 "$LOGS/tests.log"
cat "$LOGS/ws.log"
for loads in ptr tma ws; do echo "loads=$loads"; grep -h "predecoded" "$LOGS/path_$loads.log"; done
