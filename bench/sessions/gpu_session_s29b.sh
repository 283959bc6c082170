#!/usr/bin/env bash
# Twenty-ninth session, second call: the decode experts on FP8 wgmma with the activations
# quantized in the GEMMs' own fill (three launches a call, PDL).  GPU tests (fused = the
# five-launch chain's bits; toy widths); why the piecewise-graph test saw 1.4e-1 at its 2-token
# step with the path on (every served call against the twin, the steps' logits on vs off, toy
# and V4-Flash widths); the whole call; all 43 layers at B=1 / 2 without and with the path.
set -u
cd "$(dirname "$0")/../.."
export TCACHE_MAX_MB=0
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage tests 120 python -m pytest -q -rf tests/kernels/test_moe_wgmma_gpu.py
grep -h "passed\|failed\|FAILED\|Error\|assert" "$LOGS/tests.log" | head -20
stage check_tiny 60 python bench/wgmma_model_check.py --layers 5 --tiny
grep "^|" "$LOGS/check_tiny.log" | head -60
stage check_flash 90 python bench/wgmma_model_check.py --layers 4 --experts 64
grep "^|" "$LOGS/check_flash.log" | tail -20
stage op 70 python bench/gluon_fp4_gemv.py --op --tokens 1,2
grep "^|" "$LOGS/op.log"
for v in 0 1; do
    stage b12_$v 95 env DSV4_MOE_WGMMA=$v python bench/flash_bench.py --layers 43 \
        --experts $EXPERTS --prefill "" --decode-batches 1,2 --ctx 8192 --steps 2
    grep -h "decode B=" "$LOGS/b12_$v.log" | cut -c1-140
done
