#!/usr/bin/env bash
# Sixth session, two H200s: (in parallel) GPU 0 — the dense-prefill GPU tests (all, no -x),
# Nsight Compute on the expert / FP8 GEMM kernels at 64 tokens, the FP8-MMA experts at decode
# batch sizes; GPU 1 — 4 V4-Flash layers (decode B 1/16/64 with the new FP8 GEMM plans,
# profiled); then the full-size V4-Flash on both (EP, graphs), tp_bench's host-phase report.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
(
  export CUDA_VISIBLE_DEVICES=0
  stage gpu_tests 110 python -m pytest -q -p no:cacheprovider -s \
      tests/model/test_dense_prefill_sources.py tests/kernels/test_hc_fused.py
  stage ncu 60 ncu --clock-control none -k regex:"_moe_up|_moe_down|_fp8_gemm" --launch-skip 3 \
      --launch-count 3 --section SpeedOfLight --section MemoryWorkloadAnalysis \
      --section ComputeWorkloadAnalysis --section WarpStateStats --section Occupancy \
      python bench/ncu_probe.py 64
  stage moe_fp8_decode 90 python bench/moe_decode_fp8.py --tokens 64,16,1,256 \
      --out "$LOGS/moe_fp8_decode.json"
) &
(
  export CUDA_VISIBLE_DEVICES=1
  stage flash 240 python bench/flash_bench.py --layers 4 --prefill 1024 \
      --decode-batches 1,16,64 --ctx 8192 --steps 3 --budget 200 --profile "$LOGS/profile" \
      --out "$LOGS/flash.json"
) &
wait
stage tp_bench 280 torchrun --nproc-per-node 2 bench/tp_bench.py --layers 43 --ep --graphs \
    --budget 245 --trace --out "$LOGS/tp_flash.json"
grep -v "^c=.* step " "$LOGS/tp_bench.log" | tail -n 25
tar -czf "$OUT/session.tar.gz" -C "$LOGS" .
