#!/usr/bin/env bash
# Thirty-first session's third call: the engine's warm-up / lanes' GPU tests with the wgmma
# experts on by default, then transformers against dsv4 on the fifteenth session's workload.
set -u
cd "$(dirname "$0")/../.."
export TCACHE_MAX_MB=0
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage engine 190 python -m pytest -q -rf tests/model/test_side_stream_gpu.py \
    tests/engine/test_warmup.py -k "gpu or cuda"
grep -h "passed\|failed\|FAILED\|Error\|assert" "$LOGS/engine.log" | head -20
stage hf 220 python bench/flash_bench.py --layers 4 --prefill 4096 --decode-batches 1 \
    --ctx 4096 --steps 3 --budget 100 --hf "4096;1:4096" --out "$LOGS/hf.json"
grep -h "prefill S\|decode B\|transformers\|hf " "$LOGS/hf.log" | grep -v "moe B" | tail -n 12
