#!/usr/bin/env bash
# Thirty-first session's second call: the wgmma GPU tests with room to compile (s30c's 90 s
# cut them off), the 43-layer targets recording into the manifest, a 4-layer B=1 timeline.
set -u
cd "$(dirname "$0")/../.."
export TCACHE_MAX_MB=0
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage tests 170 python -m pytest -q -rf tests/kernels/test_moe_wgmma_gpu.py
grep -h "passed\|failed\|FAILED\|Error\|assert" "$LOGS/tests.log" | head -20
cp dsv4/ops/kernels_sm90.json "$OUT/kernels_sm90.json"
export DSV4_RECORD_KERNELS="$OUT/kernels_sm90.json"
stage full43 220 python bench/flash_bench.py --layers 43 --experts $EXPERTS --prefill 8192 \
    --decode-batches 1,64 --ctx 8192 --steps 2 --reps 2 --budget 200 --out "$LOGS/full43.json"
grep -h "prefill S\|decode B\|model built" "$LOGS/full43.log" | tail -n 12
unset DSV4_RECORD_KERNELS
python -c "import json; d=json.load(open('$OUT/kernels_sm90.json')); k=d['kernels']; print(len(k), 'kernels,', sum('gluon' in e['module'] for e in k), 'gluon')"
stage tl 90 python bench/flash_bench.py --layers 4 --prefill "" --decode-batches 1 \
    --ctx 8192 --steps 2 --budget 75 --timeline "$LOGS/tl.txt" --out "$LOGS/tl.json"
grep -h "decode B" "$LOGS/tl.log"
