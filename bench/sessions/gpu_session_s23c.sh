#!/usr/bin/env bash
# Twenty-third session, run C: piecewise CUDA graphs of prefill steps (dsv4.engine.prefill_graphs,
# new): their GPU test (captured replays against the eager forward over prefill / mixed /
# decode steps), the model's lanes test after the attention's split into project / attend /
# output, and the 4-layer prefill at 128-2,048 tokens with and without the graphs.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage pg_test 120 python -m pytest -q -x tests/engine/test_prefill_graphs.py
stage pre_graphs 90 python bench/flash_bench.py --layers 4 --prefill 128,256,512,1024,2048 \
    --decode-batches "" --reps 5 --budget 80 --prefill-graphs 2048 --out "$LOGS/pre_graphs.json"
stage pre_eager 70 python bench/flash_bench.py --layers 4 --prefill 128,256,512,1024,2048 \
    --decode-batches "" --reps 5 --budget 60 --out "$LOGS/pre_eager.json"
stage lanes 90 python -m pytest -q -x tests/model/test_side_stream_gpu.py
tail -n 3 "$LOGS/pg_test.log" "$LOGS/lanes.log"
for p in graphs eager; do echo "prefill: $p"; grep -h "prefill S=\|rror" "$LOGS/pre_$p.log" | tail -n 6; done
