#!/usr/bin/env bash
# Ninth session: the mHC Sinkhorn on the comb lane — its GPU bits tests (kernels at V4-Flash
# widths, the tiny-schedule model eager + graph), the wo_a model test, then the 4-layer decode
# launch variants (plain / PDL / PDL without the comb lane) at B 1, 16, 64 in one process.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage t_mhc 90 python -m pytest -q -p no:cacheprovider tests/kernels/test_mhc_norm.py -k gpu
stage t_model 120 python -m pytest -q -p no:cacheprovider tests/model/test_side_stream_gpu.py
stage ab 200 python bench/flash_bench.py --layers 4 --prefill "" --decode-batches 1,16,64 \
    --ctx 8192 --steps 2 --budget 180 --launch-ab --out "$LOGS/ab.json"
grep -h "decode B" "$LOGS"/ab.log | tail -n 3
