#!/usr/bin/env bash
# Written in the twenty-sixth session for an H200 (not run: none came; s26f ran its tests on an
# H100): the engine GPU tests, which now start with the warm-up (on by default on
# one GPU), and the warm-up's own GPU test (workloads within its envelope load no Triton
# kernel; on failure it lists those they did).  On an H200 first the 43-layer targets of issue
# #5 (B=1 / B=64 decode and the 8K prefill; last measured in the seventeenth / eighteenth
# sessions, every later run was on an H100).  Meant to run with .tcache carried (Triton's cache).
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
ENGINE_SECS=330
if [ "$EXPERTS" = 128 ]; then
    stage full43 250 python bench/flash_bench.py --layers 43 --experts 128 --prefill 8192 \
        --decode-batches 1,64 --ctx 8192 --steps 2 --reps 2 --budget 235
    ENGINE_SECS=110
fi
stage warmup_gpu 200 python -m pytest -q -x tests/engine/test_warmup.py -k gpu
stage engine_gpu $ENGINE_SECS python -m pytest -q tests/engine/test_cuda_graphs_gpu.py \
    tests/engine/test_prefill_graphs.py tests/engine/test_moe_fp8_codes_gpu.py -k gpu
[ -f "$LOGS/full43.log" ] && grep -h "prefill\|decode\|B=" "$LOGS/full43.log" | head -20
tail -n 30 "$LOGS/warmup_gpu.log" | cut -c1-400
tail -n 5 "$LOGS/engine_gpu.log"
