#!/usr/bin/env bash
# Twenty-sixth session, last call: the shipped kernel manifest (dsv4/ops/kernels_sm90.json,
# recorded by s26e) at its default path — an engine starting on an EMPTY Triton cache serves
# short prompts at c=1 / 16 (start time; what loads during the workloads) — then the warm-up's
# GPU test (now: only length-specialized kernels may load after it) and the engine GPU tests,
# which start with the precompile and the warm-up.  Meant to run with .tcache carried.
set -u
cd "$(dirname "$0")/../.."
export TCACHE_MAX_MB=0   # the session's last call: nothing to carry on
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS, tp_stage
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
mkdir -p /tmp/empty_triton_cache
TRITON_CACHE_DIR=/tmp/empty_triton_cache \
    tp_stage fresh_short 130 --concurrency 1,16 --prompt-len 256 --output-len 16
stage warmup_gpu 110 python -m pytest -q -x tests/engine/test_warmup.py -k gpu
stage engine_gpu 280 python -m pytest -q tests/engine/test_cuda_graphs_gpu.py \
    tests/engine/test_prefill_graphs.py tests/engine/test_moe_fp8_codes_gpu.py -k gpu
grep -h "engine\|c=\|^ *[0-9]\+ \|^    _" "$LOGS"/fresh_short.log | grep -v "host ms" | head -40
tail -n 12 "$LOGS/warmup_gpu.log" | cut -c1-300
tail -n 8 "$LOGS/engine_gpu.log" | cut -c1-300
