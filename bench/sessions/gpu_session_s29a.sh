#!/usr/bin/env bash
# Twenty-ninth session, first call: the GPU suite's expert-touching parts with the decode
# experts on FP8 wgmma switched on (DSV4_MOE_WGMMA=1: the tiny V4 model under official
# numerics qualifies, so the engine tests run it at decode), and bench/gluon_fp4_gemv.py's GEMM
# mode, which has not run since it was rebuilt on the module's kernel.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage gemm 70 python bench/gluon_fp4_gemv.py --tokens 1,2
grep "^|" "$LOGS/gemm.log"
stage on_kernels 200 env DSV4_MOE_WGMMA=1 python -m pytest -q -rf \
    tests/kernels/test_moe_wgmma_gpu.py tests/kernels/test_moe_gemv.py \
    tests/kernels/test_moe_kchunk_gpu.py tests/engine/test_moe_fp8_codes_gpu.py
grep -h "passed\|failed\|FAILED\|Error" "$LOGS/on_kernels.log" | head -20
stage on_engine 270 env DSV4_MOE_WGMMA=1 python -m pytest -q -rf \
    tests/model/test_side_stream_gpu.py tests/engine/test_warmup.py \
    tests/engine/test_prefill_graphs.py tests/model/test_attention_cuda.py
grep -h "passed\|failed\|FAILED\|Error" "$LOGS/on_engine.log" | head -20
