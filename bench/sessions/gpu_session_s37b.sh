#!/usr/bin/env bash
# (Historical: plan texts pdec[N]t were the TMA-fed persistent form; since 95dc797 every
# persistent plan is TMA-fed and the text is pdec[N].)
# Thirty-seventh session: the persistent decode-warpgroup form of the MXFP4 GEMMs
# (_gemm_mx_pdec_kernel, written without a GPU; pdecN: the products of N steps chained a loop
# turn): its plans against the default ones at 8K / 32K tokens (bench/moe_gluon_mx.py, bits
# against the Triton kernels), the GPU test of every form, the 4-layer 8K prefill with the
# chained plans against the defaults; where the 4-layer 8K prefill goes (torch.profiler).
set -u
cd "$(dirname "$0")/../.."
export TCACHE_MAX_MB=0
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage mxbench 200 python bench/moe_gluon_mx.py --tokens 8192,32768 \
    --plans up:128:4:1:4:dec,up:128:4:1:4:pdec,up:128:4:1:4:pdec2,up:128:4:1:3:pdec2,down:128:4:1:3,down:128:4:1:4:pdec,down:128:4:1:4:pdec4,down:128:4:1:3:pdec4,down:128:4:1:4:pdec2,up:128:4:1:4:pdec2t,down:128:4:1:4:pdec4t
grep -h "^|" "$LOGS/mxbench.log"
stage mxtest 110 python -m pytest -q -x tests/kernels/test_moe_fp8mma_gpu.py -k "mx_gemms"
grep -h "passed\|failed\|Error" "$LOGS/mxtest.log" | tail -n 5
for p in "128:4:1:4:pdec2,128:4:1:4:pdec4" "" ; do
    DSV4_FP8MMA_MX_PLANS=$p stage "ab_${p:0:12}" 60 python bench/flash_bench.py --layers 4 \
        --prefill 8192 --decode-batches "" --reps 3
    echo "plans '${p}':"; grep -h "prefill S=" "$LOGS/ab_${p:0:12}.log" | tail -n 1
done
stage prof 100 python bench/flash_bench.py --layers 4 --prefill 8192 --decode-batches "" \
    --reps 1 --ctx 8192 --profile "$OUT/prefill_prof.txt"
grep -A 34 "prefill 8192" "$OUT/prefill_prof.txt" | head -n 36
