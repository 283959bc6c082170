#!/usr/bin/env bash
# Twenty-ninth session, third call: the one-token decode experts on FP8 wgmma on by default
# (MAX_TOKENS 1, the w2 GEMM with one chunk in flight): its GPU tests, the engine / model GPU
# tests that run official numerics, the GEMMs per plan at one token, the whole call, and the
# 43-layer B=1 step against the grouped kernels (interleaved graph replays).
set -u
cd "$(dirname "$0")/../.."
export TCACHE_MAX_MB=0
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage tests 70 python -m pytest -q -rf tests/kernels/test_moe_wgmma_gpu.py
grep -h "passed\|failed\|FAILED\|Error\|assert" "$LOGS/tests.log" | head -20
stage engine 220 python -m pytest -q -rf tests/engine/test_prefill_graphs.py \
    tests/engine/test_moe_fp8_codes_gpu.py tests/model/test_side_stream_gpu.py \
    tests/engine/test_warmup.py -k "gpu or cuda"
grep -h "passed\|failed\|FAILED\|Error\|assert" "$LOGS/engine.log" | head -20
stage op 40 python bench/gluon_fp4_gemv.py --op --tokens 1
grep "^|" "$LOGS/op.log"
stage ab43 90 python bench/flash_bench.py --layers 43 --experts $EXPERTS --prefill "" \
    --decode-batches 1 --ctx 8192 --steps 2 --launch-ab --ab-variants "pdl;pdl, experts on Triton"
grep -h "decode B=" "$LOGS/ab43.log" | head -3
stage gemm 50 python bench/gluon_fp4_gemv.py --tokens 1
grep "^|" "$LOGS/gemm.log"
