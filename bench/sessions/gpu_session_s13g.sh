#!/usr/bin/env bash
# Thirteenth session, last call (~4 min; ~340 s of device time were left): the window branch of
# V4 window-only / HCA layers on the side lane (attention.KV_ON_SIDE_LANE) — the lanes' bits
# test, then 4-layer B=1 with every launch variant interleaved (one of them: the window branch
# on the main lane, as before).
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage tests 80 python -m pytest -q -x -p no:cacheprovider tests/model/test_side_stream_gpu.py \
    -k side_stream_same_logits
stage ab 170 python bench/flash_bench.py --layers 4 --prefill "" --decode-batches 1 \
    --ctx 8192 --steps 2 --budget 150 --launch-ab --out "$LOGS/ab.json"
grep -h "decode B" "$LOGS"/ab.log
tail -n 2 "$LOGS"/tests.log
