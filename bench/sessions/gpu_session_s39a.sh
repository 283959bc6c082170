#!/usr/bin/env bash
# Written in the thirty-eighth session for the next (~330 s on an H200): the 43-layer 8K
# prefill target with the new MXFP4 defaults (up persistent TMA-fed pdec2, down plain 4
# stages) against the per-call re-encoding, alternating (128 experts a layer on an H200, 64 on
# an H100: EXPERTS; the thirty-first session's H200 number: 669.5 ms, 4.29x, re-encoding);
# then the persistent down GEMM with 256-row blocks (one decoded tile for 256 rows; chain 1:
# chain 2 spills offline) against the plain default at 8K / 32K tokens.
set -u
cd "$(dirname "$0")/../.."
export TCACHE_MAX_MB=0
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for v in 1 0; do
    DSV4_FP8MMA_MX=$v stage "p43_${v}" 200 python bench/flash_bench.py --layers 43 \
        --experts $EXPERTS --prefill 8192 --decode-batches "" --reps 2 --budget 180
    grep -h "prefill S=" "$LOGS"/p43_${v}.log | tail -n 1
done
stage mxbench 90 python bench/moe_gluon_mx.py --tokens 8192,32768 \
    --plans up:128:4:1:4:pdec2,down:128:4:1:4,down:256:4:1:3:pdec1,down:256:4:1:3:pdec,down:256:4:1:3:dec
grep -h "^|" "$LOGS/mxbench.log"
