#!/usr/bin/env bash
# Written in the thirteenth session, not run (its device time ran out; ~2.5 min): the window
# branch of V4 window-only / HCA layers on the side lane (attention.KV_ON_SIDE_LANE, off by
# default) — 4-layer B=1 with every launch variant interleaved; one of them turns the side-lane
# window branch on, and each variant's logits are compared bit for bit with the plain launch's.
# If it is faster and bit-equal: set KV_ON_SIDE_LANE = 1 and run the lanes' bits test
# (tests/model/test_side_stream_gpu.py).
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage ab 150 python bench/flash_bench.py --layers 4 --prefill "" --decode-batches 1 \
    --ctx 8192 --steps 2 --budget 140 --launch-ab --out "$LOGS/ab.json"
grep -h "decode B" "$LOGS"/ab.log
