#!/usr/bin/env bash
# Eighth session, third H200 call: PDL as landed (no weight reads before the wait; only for
# model steps of <= 16 tokens): the bits tests, the launch variants at B 1/16/32/64 in one
# process, the 4-layer table (prefill 8K, decode B 1-256), the fixed split-K test, the engine's
# graph tests.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage t_pdl 90 python -m pytest -q -p no:cacheprovider tests/model/test_side_stream_gpu.py
stage ab 150 python bench/flash_bench.py --layers 4 --prefill "" --decode-batches 1,16,32,64 \
    --ctx 8192 --steps 2 --budget 130 --launch-ab --out "$LOGS/ab.json"
stage flash 150 python bench/flash_bench.py --layers 4 --prefill 8192 \
    --decode-batches 1,16,64,256 --ctx 8192 --steps 3 --budget 120 \
    --timeline "$LOGS/timeline.txt" --out "$LOGS/flash.json"
stage t_splitk 60 python -m pytest -q -p no:cacheprovider tests/kernels/test_gpu_kernels.py \
    -k "split_k_reproducible or linear_fp32"
stage t_graphs 90 python -m pytest -q -p no:cacheprovider tests/engine/test_cuda_graphs_gpu.py
grep -h "^\[" "$LOGS"/ab.log "$LOGS"/flash.log | grep -v "moe B" | tail -n 12
tar -czf "$OUT/session.tar.gz" -C "$LOGS" .
