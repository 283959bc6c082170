#!/usr/bin/env bash
# Written in the twenty-fourth session for the next machine (not run): the prefill graphs' GPU
# tests (the V4.1 case now makes V4.1's compressor rows and index queries in the graphs, which no
# GPU has run), then the engine's memory headroom with the graphs captured and the cache sized at
# gpu_memory_utilization 0.9: long prompts, whose 2,048-token chunks run eagerly next to the
# graphs' pool (an out-of-memory here means the engine's estimate of that pool is short).
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage pg_gpu 200 python -m pytest -q tests/engine/test_prefill_graphs.py -k gpu
stage tp_long 340 python -m torch.distributed.run --standalone --nproc-per-node 1 \
    bench/tp_bench.py --layers 43 --experts $EXPERTS --graphs --concurrency 4 \
    --prompt-len 8192 --output-len 16 --max-num-batched-tokens 2048 --budget 320 \
    --out "$LOGS/tp_long.json"
tail -n 3 "$LOGS/pg_gpu.log"
grep -h "TTFT\|^ *4 \|rror\|memory" "$LOGS/tp_long.log" | tail -n 12
