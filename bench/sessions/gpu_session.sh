#!/usr/bin/env bash
# Everything that waits for a GPU, in one command for one device call (1x H200, < 10 min):
#   bash bench/sessions/gpu_session.sh            (logs and JSON under $OUT, or ./gpu_out)
# Stages are time-boxed so a slow one cannot eat the others; each writes <stage>.log.
# The numbers go to docs/PERFORMANCE.md with this command, the date and the hardware.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$LOGS/gpu.txt" 2>&1
python -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$LOGS/gpu.txt"

# 1. The routed experts first (this session's rework: activation prep pass, inline-PTX MXFP4
#    decode): GPU tests, then timings of both decodes, then the 4-layer model end to end.
stage gpu_moe 130 python -m pytest -q -p no:cacheprovider tests/kernels/test_moe_fast.py \
    tests/kernels/test_gpu_kernels.py -k "moe"
stage moe_decode 90 python bench/moe_decode.py --sweep --out "$LOGS/moe_decode.json"
stage moe_decode_alu 35 env DSV4_FP4_DECODE=alu python bench/moe_decode.py \
    --out "$LOGS/moe_decode_alu.json"
# 2. End to end, 4 V4-Flash layers: decode B=1/16/64 at 8K context and 8K prefill.
stage flash 110 python bench/flash_bench.py --layers 4 --prefill 8192 --decode-batches 1,16,64 \
    --ctx 8192 --steps 3 --budget 95 --out "$LOGS/flash.json" --profile "$LOGS/profile"
# 3. Correctness of every other kernel at real shapes (the GPU halves of the kernel tests).
stage gpu_tests 180 python -m pytest -q -p no:cacheprovider \
    tests/kernels/test_gpu_kernels.py -k "not moe" \
    tests/kernels/test_triton_norm.py tests/kernels/test_triton_compress.py \
    $(ls tests/kernels/test_triton_route.py tests/kernels/test_triton_index.py \
         tests/kernels/test_triton_records.py 2>/dev/null) \
    tests/engine/test_cuda_graphs_gpu.py
# (bench/norm_rope.py and bench/compressor.py: kernel timings, run when those kernels change.)
