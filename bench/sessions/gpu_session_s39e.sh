#!/usr/bin/env bash
# Thirty-ninth session (~400 s): the in-place inverse RoPE and wo_a's strided batched GEMM —
# their GPU tests, bench/prefill_glue.py, then the 4-layer and 43-layer 8K prefill against the
# tree before them (.base39/ holds that commit's attention.py and triton_attn.py; the call
# copies it as untracked files), alternating; then the expert call at 2K / 3K tokens (48 / 72
# pairs an expert: the engine's default 2,048-token steps) on the bf16-MMA kernels against
# the MXFP4 GEMMs with 128-, 64- and 32-row blocks.
set -u
cd "$(dirname "$0")/../.."
export TCACHE_MAX_MB=0
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
rm -rf /tmp/base && mkdir -p /tmp/base && cp -r dsv4 bench /tmp/base/ && cp -r .base39/dsv4 /tmp/base/
stage tests 150 python -m pytest -q -x tests/kernels/test_triton_norm.py \
    tests/kernels/test_gpu_kernels.py tests/model/test_attention_cuda.py \
    -k "gpu_v4_flash_shapes or rope_out or cuda_matches or bf16_compute"
stage glue 60 python bench/prefill_glue.py
grep -h "^|" "$LOGS/glue.log"
for i in 1 2; do
    stage "p4_new_$i" 60 python bench/flash_bench.py --layers 4 --prefill 8192 \
        --decode-batches "" --reps 3
    grep -h "prefill S=" "$LOGS/p4_new_$i.log" | tail -n 1
    (cd /tmp/base && stage "p4_base_$i" 60 python bench/flash_bench.py --layers 4 \
        --prefill 8192 --decode-batches "" --reps 3)
    grep -h "prefill S=" "$LOGS/p4_base_$i.log" | tail -n 1
done
for i in 1 2; do
    stage "p43_new_$i" 100 python bench/flash_bench.py --layers 43 --experts $EXPERTS \
        --prefill 8192 --decode-batches "" --reps 2
    grep -h "prefill S=" "$LOGS/p43_new_$i.log" | tail -n 1
    (cd /tmp/base && stage "p43_base_$i" 100 python bench/flash_bench.py --layers 43 \
        --experts $EXPERTS --prefill 8192 --decode-batches "" --reps 2)
    grep -h "prefill S=" "$LOGS/p43_base_$i.log" | tail -n 1
done
stage mx2k 150 python bench/moe_gluon_mx.py --tokens 2048,3072 \
    --plans up:128:4:1:4:pdec2,up:64:4:1:4,up:64:4:1:3,up:64:8:1:3,up:32:4:1:4,down:128:4:1:4,down:64:4:1:4,down:64:8:1:4,down:32:4:1:4
grep -h "^|" "$LOGS/mx2k.log"
