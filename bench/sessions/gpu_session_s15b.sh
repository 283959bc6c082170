#!/usr/bin/env bash
# Fifteenth session, second call (~7 min): moe_gate (gate GEMM + routing in one launch) and
# moe_experts_shared (the routed + shared sum in the experts' combine launch) — their GPU tests,
# the lanes' bits test with them on, the 4-layer B=1 launch A/B (a variant without them) and
# timeline, B 16 / 64.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage route 120 python -m pytest -q -x tests/kernels/test_triton_route.py -k "gpu"
stage lanes 130 python -m pytest -q -x tests/model/test_side_stream_gpu.py
stage ab 150 python bench/flash_bench.py --layers 4 --prefill "" --decode-batches 1 \
    --ctx 8192 --steps 2 --budget 140 --launch-ab --timeline "$LOGS/tl.txt" --out "$LOGS/ab.json"
stage dec 120 python bench/flash_bench.py --layers 4 --prefill "" --decode-batches 16,64 \
    --ctx 8192 --steps 2 --budget 100 --out "$LOGS/dec.json"
grep -h "passed\|failed" "$LOGS"/route.log "$LOGS"/lanes.log | tail -n 4
grep -h "decode B\|variant\|bit" "$LOGS"/ab.log | tail -n 14
grep -h "decode B" "$LOGS"/dec.log
