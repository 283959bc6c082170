#!/usr/bin/env bash
# Twenty-seventh session, second call: the two launches taken off the decode chain — the
# attention output's inverse RoPE in the split-KV merge (on), the act prep in the up kernel
# (DSV4_MOE_UP_PREP) and the combine in the down kernel (DSV4_MOE_DOWN_COMBINE), both off until this A/B — GPU tests, then the 4-layer decode A/B (interleaved
# graph replays, same bits) at B 1 / 2 / 16 / 64 and the B=1 timeline.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage tests 200 python -m pytest -q -x tests/kernels/test_gpu_kernels.py -k "rope_out or sparse_attn" \
    tests/kernels/test_moe_kchunk_gpu.py tests/model/test_side_stream_gpu.py
stage ab 240 python bench/flash_bench.py --layers 4 --prefill "" --decode-batches 1,2,16,64 \
    --ctx 8192 --steps 2 --budget 220 --launch-ab --out "$LOGS/ab.json" --ab-variants \
    "pdl;pdl, inverse rope in its own launch;pdl, act prep in the up kernel;pdl, combine in the down kernel;pdl, act prep in up, combine in down"
stage tl 100 python bench/flash_bench.py --layers 4 --prefill "" --decode-batches 1 \
    --ctx 8192 --steps 2 --budget 80 --timeline "$LOGS/tl.txt" --out "$LOGS/tl.json"
grep -h "passed\|failed\|Error" "$LOGS/tests.log" | tail -n 5
grep -h "median\|B=\|same_bits\|variant" "$LOGS/ab.log" | head -n 40
head -n 6 "$LOGS/tl.txt"
