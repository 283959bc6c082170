#!/usr/bin/env bash
# Thirtieth session, final attempt (~250 s of device time left): the 43-layer B=1 A/B of the
# wgmma default against the grouped kernels and the early-weights option, recording its kernels
# into a copy of the shipped manifest (the Gluon GEMMs are not in it yet).
set -u
cd "$(dirname "$0")/../.."
export TCACHE_MAX_MB=0
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
cp dsv4/ops/kernels_sm90.json "$OUT/kernels_sm90.json"
stage ab43 140 env DSV4_RECORD_KERNELS="$OUT/kernels_sm90.json" python bench/flash_bench.py \
    --layers 43 --experts $EXPERTS --prefill "" --decode-batches 1 --ctx 8192 --steps 2 \
    --launch-ab --ab-variants "pdl;pdl, experts on Triton;pdl, wgmma weights before the fill"
grep -h "decode B=" "$LOGS/ab43.log" | head -3
python -c "import json; d=json.load(open('$OUT/kernels_sm90.json')); k=d['kernels']; print(len(k), 'kernels,', sum('gluon' in e['module'] for e in k), 'gluon')"
