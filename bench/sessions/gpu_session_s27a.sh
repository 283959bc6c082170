#!/usr/bin/env bash
# Written in the twenty-sixth session for the next machine (not run): the final form of the
# kernel precompile (its cache check moved into the background job after runs C-E) on an EMPTY
# Triton cache — 43 layers, short prompts at c=1 / 16; then 8K prompts at c=4 on the cache that
# left — recording into a copy of the shipped manifest meanwhile, so that what this machine's
# workloads load (on an H200: 128 routed experts a layer, other MoE specializations) can be
# merged into dsv4/ops/kernels_sm90.json (copy $OUT/kernels_sm90.json over it).  Carry .tcache
# for the GPU tests' kernels; the engine stages use their own empty cache.
set -u
cd "$(dirname "$0")/../.."
export TCACHE_MAX_MB=0
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS, tp_stage
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
cp dsv4/ops/kernels_sm90.json "$OUT/kernels_sm90.json"
mkdir -p /tmp/empty_triton_cache
export DSV4_RECORD_KERNELS="$OUT/kernels_sm90.json"
TRITON_CACHE_DIR=/tmp/empty_triton_cache \
    tp_stage fresh_short 150 --concurrency 1,16 --prompt-len 256 --output-len 16
TRITON_CACHE_DIR=/tmp/empty_triton_cache \
    tp_stage fresh_long 120 --concurrency 4 --prompt-len 8192 --output-len 8
unset DSV4_RECORD_KERNELS
python -c "import json; d=json.load(open('$OUT/kernels_sm90.json')); print(len(d['kernels']), 'kernels in the merged manifest')"
stage precompile_tests 120 python -m pytest -q tests/kernels/test_precompile.py \
    tests/engine/test_warmup.py -k "gpu or precompile"
grep -h "engine\|c=\|^ *[0-9]\+ \|^    _" "$LOGS"/fresh_short.log "$LOGS"/fresh_long.log \
    | grep -v "host ms" | head -50
tail -n 5 "$LOGS/precompile_tests.log"
