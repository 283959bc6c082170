#!/usr/bin/env bash
# Seventh session, second two-H200 call: GPU checks of this session's kernels on GPU 0 (grouped
# wo_a, bf16-held fp32-math weights, the side stream, mHC collapse + norm, FP8 GEMV, swapped
# MoE operands), benches and the 4-layer decode timeline on GPU 1.
#   bash bench/sessions/gpu_session_s7b.sh        (logs packed into $OUT/session.tar.gz)
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
(
  export CUDA_VISIBLE_DEVICES=1
  stage grouped_bench 80 python bench/grouped_bench.py --T 1,16,64,256,1024,2048,4096,8192
  stage gemv_quick 70 python bench/fp8_decode_sweep.py --quick --out "$LOGS/fp8_gemv.json"
  stage lin_bf16w 80 python bench/kernels.py --only linear_bf16w --sweep
  stage mhc_norm 80 python bench/sweep_glue.py --ops norm --tokens 1,64,8192 --budget 60 \
      --out "$LOGS/sweep_mhc_norm.json"
  stage flash_side 130 python bench/flash_bench.py --layers 4 --prefill 8192 \
      --decode-batches 1,64 --ctx 8192 --steps 3 --budget 100 --timeline "$LOGS/timeline.txt" \
      --out "$LOGS/flash.json"
  stage flash_noside 70 env DSV4_SIDE_STREAM=0 python bench/flash_bench.py --layers 4 \
      --prefill "" --decode-batches 1 --ctx 8192 --steps 3 --budget 50 \
      --timeline "$LOGS/timeline_noside.txt" --out "$LOGS/flash_noside.json"
) &
export CUDA_VISIBLE_DEVICES=0
stage t_grouped 90 python -m pytest -q -p no:cacheprovider tests/kernels/test_grouped.py -k gpu
stage t_lin32 90 python -m pytest -q -p no:cacheprovider tests/kernels/test_gpu_kernels.py \
    -k "linear_fp32 or hc or norm"
stage t_side 90 python -m pytest -q -p no:cacheprovider tests/model/test_side_stream_gpu.py
stage t_mhc 90 python -m pytest -q -p no:cacheprovider tests/kernels/test_mhc_norm.py \
    tests/kernels/test_hc_fused.py
stage t_gemv 90 python -m pytest -q -p no:cacheprovider tests/kernels/test_fp8_gemv.py
stage t_swap 90 python -m pytest -q -p no:cacheprovider tests/kernels/test_moe_fast.py \
    -k "swap or fold_decode"
stage moe_swap 70 python bench/moe_decode.py --tokens 1,64,8192 --swap both \
    --out "$LOGS/moe_swap.json"
wait
grep -h "^\[" "$LOGS"/flash*.log | tail -n 16
tar -czf "$OUT/session.tar.gz" -C "$LOGS" .
