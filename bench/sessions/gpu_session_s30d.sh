#!/usr/bin/env bash
# Thirtieth session's second call (if the budget allows): the warm-up / lanes' GPU tests with
# the wgmma experts on by default, the load-width probe and the GEMMs per plan (staged rings),
# then transformers against dsv4 on the fifteenth session's 4-layer workload.
set -u
cd "$(dirname "$0")/../.."
export TCACHE_MAX_MB=0
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage engine 190 python -m pytest -q -rf tests/model/test_side_stream_gpu.py \
    tests/engine/test_warmup.py -k "gpu or cuda"
grep -h "passed\|failed\|FAILED\|Error\|assert" "$LOGS/engine.log" | head -20
stage probe 60 python bench/gemv_load_probe.py
grep "^|" "$LOGS/probe.log"
stage gemm 90 python bench/gluon_fp4_gemv.py --tokens 1
grep "^|" "$LOGS/gemm.log"
stage hf 200 python bench/flash_bench.py --layers 4 --prefill 4096 --decode-batches 1 \
    --ctx 4096 --steps 3 --budget 100 --hf "4096;1:4096" --out "$LOGS/hf.json"
grep -h "prefill S\|decode B\|transformers\|hf " "$LOGS/hf.log" | grep -v "moe B" | tail -n 12
