#!/usr/bin/env bash
# Twentieth session, run C: the MXFP4 experts' FP8 re-encoding kept on the GPU (new: engine
# option moe_fp8_codes, triton_moe_fp8.encode_fp8_codes): GPU tests, the expert call at 1K-8K
# tokens with kept codes against re-encoding per call and the bf16-MMA kernels, the 4-layer
# prefill with and without it.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage tests 150 python -m pytest -q -x tests/kernels/test_moe_fp8mma_gpu.py -k "kept or predecoded_gpu"
stage experts 150 python bench/moe_prefill_fp8.py --tokens 1024,2048,4096,8192 --kept \
    --out "$LOGS/experts.json"
stage pre_default 120 python bench/flash_bench.py --layers 4 --prefill 4096,8192 \
    --decode-batches "" --reps 3 --budget 100 --out "$LOGS/pre_default.json"
stage pre_kept 120 python bench/flash_bench.py --layers 4 --prefill 4096,8192 --moe-fp8-codes \
    --decode-batches "" --reps 3 --budget 100 --out "$LOGS/pre_kept.json"
tail -n 3 "$LOGS/tests.log"
grep -h "|" "$LOGS/experts.log"
for p in default kept; do echo "prefill=$p"; grep -h "prefill\|kept FP8\|Error" "$LOGS/pre_$p.log" | tail -n 6; done
