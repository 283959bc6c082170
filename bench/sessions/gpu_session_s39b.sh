#!/usr/bin/env bash
# Thirty-ninth session (~420 s): where the 4-layer 8K prefill's time goes with the new MXFP4
# defaults (torch.profiler, every kernel: the tables in $LOGS/prof8k.txt), then the
# thirty-eighth session's s39a (the 43-layer 8K prefill against the re-encoding; the 256-row
# persistent down GEMM against the plain default).
set -u
cd "$(dirname "$0")/../.."
export TCACHE_MAX_MB=0
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage prof8k 100 python bench/flash_bench.py --layers 4 --prefill "" --decode-batches "" \
    --ctx 8192 --profile "$LOGS/prof8k.txt"
sed -n '/===== prefill/,/===== decode/p' "$LOGS/prof8k.txt" | cut -c1-200 | head -n 40
for v in 1 0; do
    DSV4_FP8MMA_MX=$v stage "p43_${v}" 200 python bench/flash_bench.py --layers 43 \
        --experts $EXPERTS --prefill 8192 --decode-batches "" --reps 2 --budget 180
    grep -h "prefill S=" "$LOGS"/p43_${v}.log | tail -n 1
done
stage mxbench 90 python bench/moe_gluon_mx.py --tokens 8192,32768 \
    --plans up:128:4:1:4:pdec2,down:128:4:1:4,down:256:4:1:3:pdec1,down:256:4:1:3:pdec,down:256:4:1:3:dec
grep -h "^|" "$LOGS/mxbench.log"
