#!/usr/bin/env bash
# Ninth session, the checks of this session's kernels and the 4-layer table: the comb lane
# (one-warp comb kernel) and the wo_a model test; the compressor's split plan at decode sizes;
# the 4-layer V4-Flash table with the launch variants at B 1 / 16 (comb lane, compressor plan);
# the split plan's own timing; the new MXFP4 scale decode (bits vs asm_v1, then its timing).
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage t_mhc 60 python -m pytest -q -p no:cacheprovider tests/kernels/test_mhc_norm.py -k gpu
stage t_model 90 python -m pytest -q -p no:cacheprovider tests/model/test_side_stream_gpu.py
stage t_compress 100 python -m pytest -q -p no:cacheprovider tests/kernels/test_compress_decode.py \
    tests/kernels/test_triton_compress.py -k gpu
stage table 190 python bench/flash_bench.py --layers 4 --prefill 8192 --decode-batches 1,16,64 \
    --ctx 8192 --steps 2 --reps 2 --budget 175 --launch-ab --out "$LOGS/table.json"
stage compress_time 60 python bench/compress_sass.py --time --out "$LOGS/compress.json"
stage t_moe 50 python -m pytest -q -p no:cacheprovider tests/kernels/test_moe_fast.py -k decode_v2
for d in asm_v1 asm; do
    stage "moe_$d" 30 env DSV4_FP4_DECODE=$d python bench/moe_decode.py --tokens 1,2,16 \
        --out "$LOGS/moe_$d.json"
done
grep -h "decode B\|prefill" "$LOGS"/table.log | tail -n 4
