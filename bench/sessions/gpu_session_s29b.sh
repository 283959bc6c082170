#!/usr/bin/env bash
# Twenty-ninth session, second call: the decode experts on FP8 wgmma with the activations
# quantized in the GEMMs' own fill (three launches a call, PDL): GPU tests (fused = the
# five-launch chain's bits), the whole call and the GEMMs alone, the 4-layer A/B, and all 43
# layers at B=1 / 2 without and with the path (separate processes).
set -u
cd "$(dirname "$0")/../.."
export TCACHE_MAX_MB=0
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage tests 120 python -m pytest -q -rf tests/kernels/test_moe_wgmma_gpu.py
grep -h "passed\|failed\|FAILED\|Error" "$LOGS/tests.log" | head -20
stage op 80 python bench/gluon_fp4_gemv.py --op --tokens 1,2,4
grep "^|" "$LOGS/op.log"
stage gemm 60 python bench/gluon_fp4_gemv.py --tokens 1
grep "^|" "$LOGS/gemm.log"
for v in 0 1; do
    stage b12_$v 95 env DSV4_MOE_WGMMA=$v python bench/flash_bench.py --layers 43 \
        --experts $EXPERTS --prefill "" --decode-batches 1,2 --ctx 8192 --steps 2
    grep -h "decode B=" "$LOGS/b12_$v.log" | cut -c1-140
done
stage ab 130 python bench/flash_bench.py --layers 4 --prefill "" --decode-batches 1 \
    --ctx 8192 --steps 2 --launch-ab \
    --ab-variants "pdl;pdl, experts on wgmma;pdl, experts on wgmma, 5 launches"
grep -h "variant\|pdl\|B=" "$LOGS/ab.log" | tail -12
