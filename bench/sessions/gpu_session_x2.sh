#!/usr/bin/env bash
# The two-GPU session (nvidia-h200-x2, < 9 min): the TP/EP CUDA-graph correctness test on two
# GPUs (what keeps `cuda_graphs_under_tp` opt-in), then the full-size V4-Flash (43 layers, random
# weights made on the GPUs, EP, CUDA graphs captured at engine start) served through the engine
# at concurrency 1, 16 and 64 (64 may be cut by the budget).
#   bash bench/sessions/gpu_session_x2.sh         (logs and JSON packed into $OUT/session.tar.gz)
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
nvidia-smi --query-gpu=name,memory.total --format=csv > "$LOGS/gpu.txt" 2>&1
stage tp_graphs_test 150 python -m pytest -q -x -p no:cacheprovider \
    tests/dist/test_tp_graphs_gpu.py
# --trace: every step's time (a decode step far above the median shows there).
stage tp_bench 330 torchrun --nproc-per-node 2 bench/tp_bench.py --layers 43 --ep --graphs \
    --budget 300 --trace --out "$LOGS/tp_flash.json"
grep -v "^c=.* step " "$LOGS/tp_bench.log" | tail -n 25
