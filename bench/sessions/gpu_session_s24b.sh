#!/usr/bin/env bash
# Twenty-fourth session, run B: the prefill graphs' GPU tests after the V4.1 capture fix and the
# engine default (on with CUDA graphs on one GPU); where the host's time goes in a 43-layer
# piecewise step (bench/host_profile.py --prefill-graphs) and the graphs' memory.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage pg_gpu 200 python -m pytest -q tests/engine/test_prefill_graphs.py -k gpu
stage hp43 300 python bench/host_profile.py --layers 43 --experts $EXPERTS --tokens 128,512 \
    --reps 3 --top 45 --prefill-graphs 1024 --stats "$LOGS/hp43"
tail -n 3 "$LOGS/pg_gpu.log"
grep -h "captured\|^## " "$LOGS/hp43.log"
