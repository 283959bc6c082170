#!/usr/bin/env bash
# Twenty-seventh session, second call (one call for all: device starts were scarce): the
# launches taken off the decode chain — the attention output's inverse RoPE in the split-KV
# merge (on), the act prep in the up kernel (DSV4_MOE_UP_PREP) and the combine in the down
# kernel (DSV4_MOE_DOWN_COMBINE), both off until this A/B.  GPU tests; the 4-layer decode A/B
# (interleaved graph replays, same bits) at B 1 / 2 / 16 / 64; and the kernel manifest
# re-recorded (the merge and expert kernels took new arguments): the A/B's variants plus the
# 43-layer engine workloads of the twenty-sixth session, into a fresh $OUT/kernels_sm90.json.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS, tp_stage
nvidia-smi --query-gpu=name --format=csv,noheader
stage tests 150 python -m pytest -q -x tests/kernels/test_gpu_kernels.py -k "rope_out or sparse_attn" \
    tests/kernels/test_moe_kchunk_gpu.py tests/model/test_side_stream_gpu.py
export DSV4_RECORD_KERNELS="$OUT/kernels_sm90.json"
stage ab 200 python bench/flash_bench.py --layers 4 --prefill "" --decode-batches 1,2,16,64 \
    --ctx 8192 --steps 2 --budget 185 --launch-ab --out "$LOGS/ab.json" --ab-variants \
    "pdl;pdl, inverse rope in its own launch;pdl, act prep in the up kernel;pdl, combine in the down kernel;pdl, act prep in up, combine in down"
TCACHE_MAX_MB=0
tp_stage rec_short 120 --concurrency 1,16 --prompt-len 256 --output-len 16
tp_stage rec_long 100 --concurrency 4 --prompt-len 8192 --output-len 8
unset DSV4_RECORD_KERNELS
python -c "import json; d=json.load(open('$OUT/kernels_sm90.json')); print(len(d['kernels']), 'kernels recorded')"
grep -h "passed\|failed\|Error" "$LOGS/tests.log" | tail -n 5
grep -h "decode B=" "$LOGS/ab.log" | head -n 8
grep -h "engine\|  c=\|^ *[0-9]* *[0-9.]* *[0-9.]* " "$LOGS"/rec_short.log "$LOGS"/rec_long.log | grep -v "host ms" | head -16
