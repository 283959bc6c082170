#!/usr/bin/env bash
# Twenty-third session, run D: the engine with prefill_graphs on a GPU (startup capture of every
# bucket, bits against the eager segments over chunked / mixed / decode steps).
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage engine 150 python -m pytest -q -x tests/engine/test_prefill_graphs.py -k gpu_engine
tail -n 15 "$LOGS/engine.log"
