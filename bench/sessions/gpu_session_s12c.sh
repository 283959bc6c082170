#!/usr/bin/env bash
# Twelfth session, third call (~9 min): MXFP4 experts K-chunk-major on the GPU (the new default
# layout) — GPU tests of the expert paths and of the engine on a tiny checkpoint, the layout
# bench at 1..8192 tokens, then the 4-layer table (prefill 8K, decode B 1 / 16 / 64).
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage tests 200 python -m pytest -q -x tests/kernels/test_moe_kchunk_gpu.py \
    tests/kernels/test_moe_fp8mma_gpu.py tests/engine/test_cuda_graphs_gpu.py \
    tests/model/test_side_stream_gpu.py tests/kernels/test_moe_fast.py
stage layout 70 python bench/moe_decode_layout.py --tokens 1,2,4,16,64,256,8192 \
    --out "$LOGS/layout.json"
stage flash 270 python bench/flash_bench.py --layers 4 --prefill 8192 --decode-batches 1,16,64 \
    --ctx 8192 --steps 2 --reps 2 --budget 250 --out "$LOGS/flash.json"
grep -h "^| [0-9]" "$LOGS"/layout.log
grep -h "moe B\|prefill S\|decode B" "$LOGS"/flash.log | tail -n 8
tail -n 3 "$LOGS"/tests.log
