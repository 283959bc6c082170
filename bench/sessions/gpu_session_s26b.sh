#!/usr/bin/env bash
# Written in the twenty-fifth session for the next machine (not run): the engine GPU tests,
# which now start with the warm-up (on by default on one GPU), and the warm-up's own GPU test
# (workloads within its envelope load no Triton kernel; on failure it lists those they did).
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage warmup_gpu 240 python -m pytest -q -x tests/engine/test_warmup.py -k gpu
stage engine_gpu 330 python -m pytest -q tests/engine/test_cuda_graphs_gpu.py \
    tests/engine/test_prefill_graphs.py tests/engine/test_moe_fp8_codes_gpu.py -k gpu
tail -n 30 "$LOGS/warmup_gpu.log" | cut -c1-400
tail -n 5 "$LOGS/engine_gpu.log"
