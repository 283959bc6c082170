#!/usr/bin/env bash
# Seventh session, third two-H200 call: the final kernels' GPU tests and the engine's graphs on
# GPU 0, the 4-layer table (prefill 1K/8K/32K, decode B 1-256 with kernel timelines) on GPU 1,
# B=64 without the side stream, then the TP/EP graph tests on both GPUs.
#   bash bench/sessions/gpu_session_s7c.sh        (logs packed into $OUT/session.tar.gz)
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
(
  export CUDA_VISIBLE_DEVICES=1
  stage flash 230 python bench/flash_bench.py --layers 4 --prefill 1024,8192,32768 \
      --decode-batches 1,16,64,256 --ctx 8192 --steps 3 --budget 200 \
      --timeline "$LOGS/timeline.txt" --out "$LOGS/flash.json"
  stage flash_noside 60 env DSV4_SIDE_STREAM=0 python bench/flash_bench.py --layers 4 \
      --prefill "" --decode-batches 64 --ctx 8192 --steps 3 --budget 40 \
      --out "$LOGS/flash_noside.json"
) &
export CUDA_VISIBLE_DEVICES=0
stage t_kernels 120 python -m pytest -q -p no:cacheprovider tests/kernels/test_gpu_kernels.py \
    tests/kernels/test_fp8_gemv.py -k "linear_fp32 or gemv"
stage t_side 80 python -m pytest -q -p no:cacheprovider tests/model/test_side_stream_gpu.py
stage t_graphs 100 python -m pytest -q -p no:cacheprovider tests/engine/test_cuda_graphs_gpu.py
wait
unset CUDA_VISIBLE_DEVICES
stage tp_graphs 200 python -m pytest -q -p no:cacheprovider tests/dist/test_tp_graphs_gpu.py
pkill -9 -f "static_child|torch.distributed.run" 2>/dev/null
grep -h "^\[" "$LOGS"/flash*.log | tail -n 20
tar -czf "$OUT/session.tar.gz" -C "$LOGS" .
