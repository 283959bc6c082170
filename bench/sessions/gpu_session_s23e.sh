#!/usr/bin/env bash
# Twenty-third session, run E: the prefill graphs' GPU tests after their buffers became shared
# by every bucket (the graph replays against the eager forward; the engine with the option).
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage pg 190 python -m pytest -q -x tests/engine/test_prefill_graphs.py -k gpu
tail -n 3 "$LOGS/pg.log"
