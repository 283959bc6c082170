#!/usr/bin/env bash
# Ninth session, last call: the lanes' bits tests (comb lane, branch lane, PDL, side lane, wo_a),
# the compressor's default split tiles, the 4-layer table with the launch variants, the engine's
# graph tests.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage t_model 90 python -m pytest -q -p no:cacheprovider tests/model/test_side_stream_gpu.py
stage t_compress 40 python -m pytest -q -p no:cacheprovider tests/kernels/test_compress_decode.py \
    -k "split-None or loop"
stage table 160 python bench/flash_bench.py --layers 4 --prefill 8192 --decode-batches 1,16,64 \
    --ctx 8192 --steps 2 --reps 2 --budget 150 --launch-ab --out "$LOGS/table.json"
stage t_engine 60 python -m pytest -q -p no:cacheprovider tests/engine/test_cuda_graphs_gpu.py
grep -h "decode B\|prefill" "$LOGS"/table.log | tail -n 4
