#!/usr/bin/env bash
# Thirtieth session's first call (device starts kept failing: s30a + s30b cut to one call).
# The wgmma GPU tests (early / staged weights: same bits), the 43-layer B=1 A/B of the default
# against the grouped kernels and the two options, the wgmma experts at B=16 / 64 (4 layers), the A/Bs recording their
# kernels into a copy of the shipped manifest (the Gluon GEMMs are not in it yet).
set -u
cd "$(dirname "$0")/../.."
export TCACHE_MAX_MB=0
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage tests 90 python -m pytest -q -rf tests/kernels/test_moe_wgmma_gpu.py
grep -h "passed\|failed\|FAILED\|Error\|assert" "$LOGS/tests.log" | head -20
# Every run from here records its kernels into a copy of the shipped manifest (written at
# each process exit, so a stage cut off by the call's limit keeps the earlier ones).
cp dsv4/ops/kernels_sm90.json "$OUT/kernels_sm90.json"
export DSV4_RECORD_KERNELS="$OUT/kernels_sm90.json"
stage ab43 130 python bench/flash_bench.py --layers 43 --experts $EXPERTS --prefill "" \
    --decode-batches 1 --ctx 8192 --steps 2 --launch-ab \
    --ab-variants "pdl;pdl, experts on Triton;pdl, wgmma weights before the fill;pdl, wgmma weights staged (4)"
grep -h "decode B=" "$LOGS/ab43.log" | head -3
# The wgmma experts past one token (MAX_TOKENS 64: 16-wide products, any pairs a block), 4
# layers (256 experts) at B=16 / 64, fused fill and five launches.
stage ab4 85 python bench/flash_bench.py --layers 4 --prefill "" --decode-batches 16,64 \
    --ctx 8192 --steps 2 --launch-ab --ab-variants \
    "pdl;pdl, wgmma experts to 64 tokens;pdl, wgmma experts to 64 tokens, 5 launches"
grep -h "decode B=" "$LOGS/ab4.log" | head -3
unset DSV4_RECORD_KERNELS
python -c "import json; d=json.load(open('$OUT/kernels_sm90.json')); k=d['kernels']; print(len(k), 'kernels,', sum('gluon' in e['module'] for e in k), 'gluon')"
# (The 43-layer targets, s30b's full43 stage, did not fit this session's device time.)
