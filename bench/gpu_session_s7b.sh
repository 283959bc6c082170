#!/usr/bin/env bash
# Seventh session, second two-H200 call: GPU checks and timings of the kernels written this
# session (grouped wo_a, bf16-held fp32-math weights, the side stream, swapped MoE operands, FP8 GEMV)
# on GPU 0, benches and the 4-layer decode timeline on GPU 1.
#   bash bench/gpu_session_s7b.sh        (logs packed into $OUT/session.tar.gz)
set -u
cd "$(dirname "$0")/.."
source bench/gpu_stages.sh   # OUT, LOGS, stage
(
  export CUDA_VISIBLE_DEVICES=1
  stage grouped_bench 100 python bench/grouped_bench.py --T 1,16,64,256,1024,2048,4096,8192
  stage gemv_quick 80 python bench/fp8_decode_sweep.py --quick --out "$LOGS/fp8_gemv.json"
  stage lin_bf16w 100 python bench/kernels.py --only linear_bf16w --sweep
  stage flash_side 150 python bench/flash_bench.py --layers 4 --prefill 8192 \
      --decode-batches 1,64 --ctx 8192 --steps 3 --budget 120 --timeline "$LOGS/timeline.txt" \
      --out "$LOGS/flash.json"
  stage flash_noside 80 env DSV4_SIDE_STREAM=0 python bench/flash_bench.py --layers 4 --prefill "" \
      --decode-batches 1 --ctx 8192 --steps 3 --budget 60 \
      --timeline "$LOGS/timeline_noside.txt" --out "$LOGS/flash_noside.json"
  stage flash_gemv 80 env DSV4_FP8_GEMV_MAX_M=4 python bench/flash_bench.py --layers 4 --prefill "" \
      --decode-batches 1 --ctx 8192 --steps 3 --budget 60 \
      --timeline "$LOGS/timeline_gemv.txt" --out "$LOGS/flash_gemv.json"
  stage moe_swap 70 python bench/moe_decode.py --tokens 1,64,8192 --swap both \
      --out "$LOGS/moe_swap.json"
) &
export CUDA_VISIBLE_DEVICES=0
stage t_grouped 120 python -m pytest -q -p no:cacheprovider tests/kernels/test_grouped.py -k gpu
stage t_lin32 120 python -m pytest -q -p no:cacheprovider tests/kernels/test_gpu_kernels.py \
    -k linear_fp32
stage t_side 120 python -m pytest -q -p no:cacheprovider tests/model/test_side_stream_gpu.py
stage t_swap 120 python -m pytest -q -p no:cacheprovider tests/kernels/test_moe_fast.py \
    -k "swap or fold_decode"
stage t_gemv 120 python -m pytest -q -p no:cacheprovider tests/kernels/test_fp8_gemv.py
wait
grep -h "^\[" "$LOGS"/flash*.log | tail -n 16
tar -czf "$OUT/session.tar.gz" -C "$LOGS" .
