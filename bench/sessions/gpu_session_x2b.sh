#!/usr/bin/env bash
# Fifth session, two H200s, first call (< 5 min): on GPU 0 the linear_fp32 prefill path against
# cuBLAS fp32, on GPU 1 at the same time four V4-Flash layers end to end (MMA experts); then
# the TP/EP CUDA-graph correctness test on both GPUs.
#   bash bench/sessions/gpu_session_x2b.sh       (logs and JSON packed into $OUT/session.tar.gz)
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
nvidia-smi --query-gpu=name,memory.total --format=csv > "$LOGS/gpu.txt" 2>&1
(
  export CUDA_VISIBLE_DEVICES=0
  stage kernels 75 python bench/kernels.py --only linear_fp32 --out "$LOGS/kernels.json"
) &
(
  export CUDA_VISIBLE_DEVICES=1
  stage flash 130 python bench/flash_bench.py --layers 4 --prefill 8192 \
      --decode-batches 1,16,64 --ctx 8192 --steps 3 --budget 110 --out "$LOGS/flash.json" \
      --profile "$LOGS/profile"
) &
wait
stage tp_graphs_test 150 python -m pytest -q -x -p no:cacheprovider \
    tests/dist/test_tp_graphs_gpu.py
tar -czf "$OUT/session.tar.gz" -C "$LOGS" .
