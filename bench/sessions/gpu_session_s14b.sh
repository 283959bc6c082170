#!/usr/bin/env bash
# Fourteenth session, second call (~6 min): CSA layers with the index keys on the branch lane
# next to the indexer's queries (attention._compressed_source, streams.branch_mark) — the lanes'
# GPU bits test, model GPU tests of the indexer, the 4-layer B=1 launch A/B and timeline, B 16/64.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage lanes 130 python -m pytest -q -x tests/model/test_side_stream_gpu.py
stage ab 150 python bench/flash_bench.py --layers 4 --prefill "" --decode-batches 1 \
    --ctx 8192 --steps 2 --budget 140 --launch-ab --timeline "$LOGS/tl.txt" --out "$LOGS/ab.json"
stage dec 150 python bench/flash_bench.py --layers 4 --prefill 8192 --decode-batches 16,64 \
    --ctx 8192 --steps 2 --reps 2 --budget 130 --out "$LOGS/dec.json"
grep -h "decode B\|prefill" "$LOGS"/ab.log "$LOGS"/dec.log | tail -n 6
