#!/usr/bin/env bash
# Thirteenth session, fifth call (~8 min): the prefill index plans without host syncs
# (ints_to_device) — the model / engine GPU tests that run prefill steps on CUDA, then the
# 4-layer table (8K prefill with its idle-gap report, decode B 1 / 16 / 64).
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage tests 170 python -m pytest -q -x tests/model/test_attention_cuda.py \
    tests/model/test_dense_prefill_sources.py tests/model/test_side_stream_gpu.py \
    tests/engine/test_cuda_graphs_gpu.py tests/engine/test_pipeline_decode.py
stage table 330 python bench/flash_bench.py --layers 4 --prefill 8192 --decode-batches 1,16,64 \
    --ctx 8192 --steps 2 --reps 3 --budget 300 --gaps "$LOGS/gaps.txt" --out "$LOGS/table.json"
grep -h "prefill S\|decode B" "$LOGS"/table.log
head -n 30 "$LOGS"/gaps.txt
tail -n 3 "$LOGS"/tests.log
