#!/usr/bin/env bash
# Sixth session, first one-H200 call: the GPU checks the fifth session did not reach (dense
# prefill sources, mHC plans), Nsight Compute on the expert and FP8 GEMM kernels at 64 tokens
# (where does their time go), and the FP8 GEMM tile-plan sweep at decode batch sizes.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage gpu_tests 120 python -m pytest -q -p no:cacheprovider -x \
    tests/model/test_dense_prefill_sources.py tests/kernels/test_hc_fused.py
stage ncu 120 ncu --clock-control none -k regex:"_moe_up|_moe_down|_fp8_gemm" --launch-skip 3 \
    --launch-count 3 --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section ComputeWorkloadAnalysis --section WarpStateStats --section Occupancy \
    --section LaunchStats python bench/ncu_probe.py 64
stage fp8_sweep 280 python bench/fp8_decode_sweep.py --rows 64,16,1,256 --out "$LOGS/fp8_sweep.json"
