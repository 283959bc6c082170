#!/usr/bin/env bash
# Thirteenth session, last call (~2.5 min; ~250 s of device time were left): the window branch
# of V4 window-only / HCA layers on the side lane (attention.KV_ON_SIDE_LANE) — 4-layer B=1 with
# every launch variant interleaved; one of them puts the window branch back on the main lane,
# and each variant's logits are compared bit for bit with the plain launch's.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage ab 150 python bench/flash_bench.py --layers 4 --prefill "" --decode-batches 1 \
    --ctx 8192 --steps 2 --budget 140 --launch-ab --out "$LOGS/ab.json"
grep -h "decode B" "$LOGS"/ab.log
