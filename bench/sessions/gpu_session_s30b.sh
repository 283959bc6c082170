#!/usr/bin/env bash
# Thirtieth session: a 4-layer B=1 timeline and the targets of #5 re-measured with the wgmma
# decode experts on by default (43 layers: B=1 / B=64 decode at an 8K context, the 8K prefill).
# (transformers on the same workload: gpu_session_s30d.sh.)
set -u
cd "$(dirname "$0")/../.."
export TCACHE_MAX_MB=0
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
# Where a layer's B=1 step goes with the wgmma experts (as run: PDL, lanes; kernel by kernel).
stage tl 90 python bench/flash_bench.py --layers 4 --prefill "" --decode-batches 1 \
    --ctx 8192 --steps 2 --budget 75 --timeline "$LOGS/tl.txt" --out "$LOGS/tl.json"
grep -h "decode B" "$LOGS/tl.log"
# The 43-layer run also records its kernels into a copy of the shipped manifest (the Gluon
# GEMMs of the one-token experts are not in it yet).
cp dsv4/ops/kernels_sm90.json "$OUT/kernels_sm90.json"
export DSV4_RECORD_KERNELS="$OUT/kernels_sm90.json"
stage full43 220 python bench/flash_bench.py --layers 43 --experts $EXPERTS --prefill 8192 \
    --decode-batches 1,64 --ctx 8192 --steps 2 --reps 2 --budget 200 --out "$LOGS/full43.json"
grep -h "prefill S\|decode B\|model built" "$LOGS/full43.log" | tail -n 12
unset DSV4_RECORD_KERNELS
python -c "import json; d=json.load(open('$OUT/kernels_sm90.json')); k=d['kernels']; print(len(k), 'kernels,', sum('gluon' in e['module'] for e in k), 'gluon')"
