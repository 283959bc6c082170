#!/usr/bin/env bash
# Twenty-sixth session: the kernel manifest (dsv4/ops/precompile.py).  With Triton's cache
# carried (.tcache), engines record what they compile or load (DSV4_RECORD_KERNELS) for the
# 8K / c=4 and the 256-token / c=1,16 workloads (the latter also checks the warm-up's coverage
# of short prompts, never measured: run s26a's short stage did not reach serving); then an
# engine starts on an EMPTY Triton cache with the recorded manifest precompiled in parallel
# (the same start took 225 s to serve in s26a's prime stage), and the warm-up's GPU test.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS, tp_stage
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
nproc
export DSV4_RECORD_KERNELS="$OUT/kernels_sm90.json"
tp_stage rec_long 100 --concurrency 4 --prompt-len 8192 --output-len 8
tp_stage rec_short 160 --concurrency 1,16 --prompt-len 256 --output-len 16
unset DSV4_RECORD_KERNELS
python -c "import json; d=json.load(open('$OUT/kernels_sm90.json')); print(len(d['kernels']), 'kernels recorded')"
mkdir -p /tmp/empty_triton_cache
TRITON_CACHE_DIR=/tmp/empty_triton_cache DSV4_KERNEL_MANIFEST="$OUT/kernels_sm90.json" \
    tp_stage fresh 170 --concurrency 1 --prompt-len 8192 --output-len 2
stage warmup_gpu 150 python -m pytest -q -x tests/engine/test_warmup.py -k gpu
grep -h "engine\|c=\|^ *[0-9]\+ \|^    _" "$LOGS"/rec_long.log "$LOGS"/rec_short.log "$LOGS"/fresh.log \
    | grep -v "host ms" | head -60
tail -n 15 "$LOGS/warmup_gpu.log" | cut -c1-300
