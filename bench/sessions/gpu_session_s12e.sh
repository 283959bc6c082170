#!/usr/bin/env bash
# Twelfth session, fifth call (~8 min): the one-program routing plan (<= 64 pairs) and the
# K-chunk-major experts — the expert / plan GPU tests, the FP8-MMA prefill experts on both
# layouts, the plan kernel's time, and the 4-layer decode B 1 / 16 (with a B=1 timeline).
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage tests 230 python -m pytest -q -x tests/kernels/test_moe_fast.py
stage fp8k 60 python bench/moe_prefill_fp8.py --tokens 8192,32768 --out "$LOGS/fp8k.json"
stage fp8r 60 python bench/moe_prefill_fp8.py --tokens 8192,32768 --rows --out "$LOGS/fp8r.json"
stage plan 40 python bench/moe_decode.py --tokens 1,16
stage dec 120 python bench/flash_bench.py --layers 4 --prefill "" --decode-batches 1,16 \
    --ctx 8192 --steps 2 --budget 100 --timeline "$LOGS/tl.txt" --out "$LOGS/dec.json"
grep -h "^| [0-9]" "$LOGS"/fp8k.log "$LOGS"/fp8r.log "$LOGS"/plan.log
grep -h "decode B" "$LOGS"/dec.log | tail -n 2
head -n 30 "$LOGS"/tl.txt
tail -n 3 "$LOGS"/tests.log
