#!/usr/bin/env bash
# Fourteenth session, first call (~7 min): the window branch of V4 window-only / HCA layers on
# the side lane (attention.KV_ON_SIDE_LANE) — 4-layer B=1 with every launch variant interleaved
# and bit-compared; the lanes' GPU bits test with it on; the B=1 graph's kernel timeline.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage ab 150 python bench/flash_bench.py --layers 4 --prefill "" --decode-batches 1 \
    --ctx 8192 --steps 2 --budget 140 --launch-ab --out "$LOGS/ab.json"
DSV4_KV_ON_SIDE_LANE=1 stage lanes 130 python -m pytest -q -x tests/model/test_side_stream_gpu.py
stage dec 150 python bench/flash_bench.py --layers 4 --prefill "" --decode-batches 1 \
    --ctx 8192 --steps 2 --budget 130 --timeline "$LOGS/tl.txt" --out "$LOGS/dec.json"
grep -h "decode B\|variant\|bit" "$LOGS"/ab.log | tail -n 12
grep -h "decode B" "$LOGS"/dec.log
