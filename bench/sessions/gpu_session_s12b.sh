#!/usr/bin/env bash
# Twelfth session, second call (~5 min): the stream-K decode expert GEMMs and K-chunk-major
# MXFP4 stacks — GPU tests, then bench/moe_decode_layout.py at 1 / 2 / 4 / 16 / 64 tokens.
# Ran at 297dd03; the stream-K schedule (and these test / bench forms) were removed in 847cba8.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage tests 150 python -m pytest -q -x tests/kernels/test_moe_streamk_gpu.py
stage layout 240 python bench/moe_decode_layout.py --tokens 1,2,4,16,64 --per-sm 2,3,4 \
    --out "$LOGS/layout.json"
grep -h "^| [0-9]" "$LOGS"/layout.log
