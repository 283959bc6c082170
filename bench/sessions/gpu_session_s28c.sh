#!/usr/bin/env bash
# Twenty-eighth session: the decode experts on FP8 wgmma (dsv4.ops.gluon_moe_decode, new):
# GPU tests, the whole expert call against Triton's, then the 4-layer decode A/B (B 1 / 2)
# with the variant.
set -u
cd "$(dirname "$0")/../.."
export TCACHE_MAX_MB=0
source bench/sessions/gpu_stages.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage tests 150 python -m pytest -q tests/kernels/test_moe_wgmma_gpu.py
grep -h "Error\|assert\|FAILED" "$LOGS/tests.log" | head -20
stage op 90 python bench/gluon_fp4_gemv.py --op --tokens 1,2,4,10
grep "^|" "$LOGS/op.log"
stage ab 170 python bench/flash_bench.py --layers 4 --prefill "" --decode-batches 1,2 \
    --ctx 8192 --steps 2 --launch-ab --ab-variants "pdl;pdl, experts on wgmma"
grep -h "variant\|pdl\|B=" "$LOGS/ab.log" | tail -20
