#!/usr/bin/env bash
# Eighteenth session, fourth call (~8 min): the one-row FP8 GEMV plans without split-K
# (pick_fp8_gemv_config, GEMV_WIDE_ONE_ROW): the GEMV GPU tests on the new defaults, the
# default plans' table (--wide: with the grouped wo_a), 4 layers at B 1 / 2 with the new rule
# and the former (DSV4_FP8_GEMV_WIDE=0), then all 43 layers at B=1.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage gputests 120 python -m pytest -q tests/kernels/test_fp8_gemv.py -k gpu
stage table 60 python bench/fp8_decode_sweep.py --gemv --wide --rows 1,2 --out "$LOGS/table.json"
stage new4 110 python bench/flash_bench.py --layers 4 --prefill "" --decode-batches 1,2 \
    --ctx 8192 --steps 2 --budget 95 --out "$LOGS/new4.json"
DSV4_FP8_GEMV_WIDE=0 stage old4 110 python bench/flash_bench.py --layers 4 --prefill "" \
    --decode-batches 1,2 --ctx 8192 --steps 2 --budget 95 --out "$LOGS/old4.json"
stage new43 170 python bench/flash_bench.py --layers 43 --experts 128 --prefill "" \
    --decode-batches 1 --ctx 8192 --steps 2 --budget 150 --out "$LOGS/new43.json"
grep -h "decode B\|passed\|failed\|gemv\|^w\|^shared" "$LOGS"/*.log | tail -n 40
