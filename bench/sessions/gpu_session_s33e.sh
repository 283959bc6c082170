#!/usr/bin/env bash
# Thirty-third session, on an H200 (128 experts a layer need its memory): the 43-layer targets
# (8K prefill, B=1, B=64) with the prefill expert GEMMs walking N tiles first (the new default),
# recording the kernel manifest (checks the offline rewrite of its expert entries); then the
# 8K prefill with the blocks first (DSV4_MOE_N_FIRST=0) on the same machine.
set -u
cd "$(dirname "$0")/../.."
export TCACHE_MAX_MB=0
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
precompile_stage 80
cp dsv4/ops/kernels_sm90.json "$OUT/kernels_sm90.json"
export DSV4_RECORD_KERNELS="$OUT/kernels_sm90.json"
stage full43 230 python bench/flash_bench.py --layers 43 --experts $EXPERTS --prefill 8192 \
    --decode-batches 1,64 --ctx 8192 --steps 2 --reps 2 --budget 200 --out "$LOGS/full43.json"
grep -h "prefill S\|decode B\|model built" "$LOGS/full43.log" | tail -n 6
unset DSV4_RECORD_KERNELS
python -c "import json; d=json.load(open('$OUT/kernels_sm90.json')); print(len(d['kernels']), 'kernels recorded + shipped')"
[ "${SKIP_BLOCKS:-0}" = 1 ] && exit 0   # gpu_session_s33g.sh: the targets alone
DSV4_MOE_N_FIRST=0 stage p43_blocks 110 python bench/flash_bench.py --layers 43 \
    --experts $EXPERTS --prefill 8192 --decode-batches "" --reps 2
grep -h "prefill S" "$LOGS/p43_blocks.log" | tail -n 1
