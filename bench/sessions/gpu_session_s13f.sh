#!/usr/bin/env bash
# Thirteenth session, sixth call: the model / engine GPU tests that s13e's 170 s stage cut off
# (20 passed there), with room to finish — prefill steps on CUDA after ints_to_device.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage tests 420 python -m pytest -q -x -p no:cacheprovider --durations=8 \
    tests/model/test_attention_cuda.py tests/model/test_dense_prefill_sources.py \
    tests/model/test_side_stream_gpu.py tests/engine/test_cuda_graphs_gpu.py \
    tests/engine/test_pipeline_decode.py
tail -n 16 "$LOGS"/tests.log
