#!/usr/bin/env bash
# Eighteenth session, sixth call (~5 min): the gate launch that also makes the routed experts'
# decode plan (triton_route.moe_gate_plan, written this session, in UNVERIFIED_ON_GPU): its GPU
# tests and the route / MoE GPU tests around it, the model's lanes bits test, 4 layers at B=1
# with it against the experts' own plan launch (interleaved replays), then 43 layers at B=1.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage gputests 150 python -m pytest -q tests/kernels/test_triton_route.py -k gpu
stage lanes 90 python -m pytest -q tests/model/test_side_stream_gpu.py
stage ab 150 python bench/flash_bench.py --layers 4 --prefill "" --decode-batches 1,2 \
    --ctx 8192 --steps 2 --budget 130 --launch-ab \
    --ab-variants "pdl;pdl, experts' plan in its own launch" --out "$LOGS/ab.json"
stage full43 100 python bench/flash_bench.py --layers 43 --experts 128 --prefill "" \
    --decode-batches 1 --ctx 8192 --steps 2 --budget 80 --out "$LOGS/full43.json"
grep -h "decode B\|passed\|failed\|Error" "$LOGS"/*.log | tail -n 30
