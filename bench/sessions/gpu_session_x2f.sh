#!/usr/bin/env bash
# Sixth session, two H200s, second call: the dense-prefill GPU tests (statistical now) on GPU 0
# alone, then graphs under TP over the new step channel (tests/dist/test_tp_graphs_gpu.py) and
# the full-size V4-Flash (EP, graphs) with tp_bench's host-phase report.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
CUDA_VISIBLE_DEVICES=0 stage gpu_tests 110 python -m pytest -q -p no:cacheprovider -s \
    tests/model/test_dense_prefill_sources.py -k gpu
stage tp_graphs 150 python -m pytest -q -p no:cacheprovider -x tests/dist/test_tp_graphs_gpu.py
stage tp_bench 280 torchrun --nproc-per-node 2 bench/tp_bench.py --layers 43 --ep --graphs \
    --budget 245 --trace --out "$LOGS/tp_flash.json"
grep -v "^c=.* step " "$LOGS/tp_bench.log" | tail -n 25
tar -czf "$OUT/session.tar.gz" -C "$LOGS" .
