#!/usr/bin/env bash
# Tenth session, first call: the compressor ops' fused ape add (dsv4/ops/triton_compress.py,
# HAS_APE; written without a GPU, gated by APE_FUSED_VERIFIED = False).
# One device call (~550 s of stage limits).
#   1. t_ape: the GPU checks of the fused add, every plan and tile of compress_entries and the
#      state update, decode (E = 1, 16, 64) and mixed prefill steps: bit-equal to scores biased
#      in torch before the call (tests/kernels/test_compress_decode.py -k ape_fused);
#   2. t_compress: the compress GPU tests without ape (default tiles; flash shapes);
#   3. t_model: the side-lane bits tests (the compressor on the branch lane, PDL on / off, eager
#      and graphs) with the model handing ape to the ops;
#   4. fused / unfused: the 4-layer decode table with the launch variants, once with the fused
#      add (gpu_stages.sh exports DSV4_UNVERIFIED_KERNELS=1, which opens the gate) and once with
#      DSV4_UNVERIFIED_KERNELS=0 (the gate closed: the model adds ape in Compressor._rows, the
#      old two launches per call; nothing else in dsv4 reads that variable while
#      dsv4.ops.UNVERIFIED_ON_GPU is empty, so the two runs differ only there).
# If t_ape, t_compress and t_model pass: set APE_FUSED_VERIFIED = True in
# dsv4/ops/triton_compress.py (and keep it only if "fused" is not slower than "unfused").
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage t_ape 200 python -m pytest -q -p no:cacheprovider tests/kernels/test_compress_decode.py \
    -k ape_fused
stage t_compress 60 python -m pytest -q -p no:cacheprovider tests/kernels/test_compress_decode.py \
    tests/kernels/test_triton_compress.py \
    -k "gpu and not ape_fused and (split] or split-None or loop or flash)"
stage t_model 90 python -m pytest -q -p no:cacheprovider tests/model/test_side_stream_gpu.py
stage fused 100 python bench/flash_bench.py --layers 4 --prefill "" --decode-batches 1,16 \
    --ctx 8192 --steps 2 --launch-ab --budget 85 --out "$LOGS/fused.json"
stage unfused 100 env DSV4_UNVERIFIED_KERNELS=0 python bench/flash_bench.py --layers 4 \
    --prefill "" --decode-batches 1,16 --ctx 8192 --steps 2 --launch-ab --budget 85 \
    --out "$LOGS/unfused.json"
grep -h "decode B" "$LOGS"/fused.log | tail -n 2
grep -h "decode B" "$LOGS"/unfused.log | tail -n 2
