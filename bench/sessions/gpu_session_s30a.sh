#!/usr/bin/env bash
# Prepared at the end of the twenty-ninth session for the next one's first call (H100 or
# H200): what that session's last device call could not run.  The wgmma GPU tests with the
# byte layout built in the kernel and the first weight chunk before the fill (same bits);
# the load-width probe and the GEMMs per plan with the weights staged through a cp.async ring
# (what bounds the one-token GEMM's stream, and whether staging lifts it); the 43-layer B=1
# A/B of the default against the grouped kernels, the early weights and the staged ones; the
# warm-up / lanes' GPU tests with the path on by default.
set -u
cd "$(dirname "$0")/../.."
export TCACHE_MAX_MB=0
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage tests 80 python -m pytest -q -rf tests/kernels/test_moe_wgmma_gpu.py
grep -h "passed\|failed\|FAILED\|Error\|assert" "$LOGS/tests.log" | head -20
stage probe 60 python bench/gemv_load_probe.py
grep "^|" "$LOGS/probe.log"
stage gemm 90 python bench/gluon_fp4_gemv.py --tokens 1
grep "^|" "$LOGS/gemm.log"
stage ab43 110 python bench/flash_bench.py --layers 43 --experts $EXPERTS --prefill "" \
    --decode-batches 1 --ctx 8192 --steps 2 --launch-ab \
    --ab-variants "pdl;pdl, experts on Triton;pdl, wgmma weights before the fill;pdl, wgmma weights staged (4)"
grep -h "decode B=" "$LOGS/ab43.log" | head -3
stage engine 190 python -m pytest -q -rf tests/model/test_side_stream_gpu.py \
    tests/engine/test_warmup.py -k "gpu or cuda"
grep -h "passed\|failed\|FAILED\|Error\|assert" "$LOGS/engine.log" | head -20
TCACHE_MAX_MB=56 save_triton_cache   # once, at the end: the Gluon kernels for later calls
