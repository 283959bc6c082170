#!/usr/bin/env bash
# Twenty-eighth session, last call: on an H200 the 43-layer targets of issue #5 (128 experts a
# layer); on an H100 the 43-layer B=1 graph step without and with the decode experts on FP8
# wgmma (DSV4_MOE_WGMMA, 64 experts a layer).  (The engine's GPU tests run the tiny bf16-numerics
# model, which the path does not serve.)
set -u
cd "$(dirname "$0")/../.."
export TCACHE_MAX_MB=0
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ "$EXPERTS" = 128 ]; then
    stage full43 200 python bench/flash_bench.py --layers 43 --experts 128 --prefill 8192 \
        --decode-batches 1,64 --ctx 8192 --steps 2 --reps 1 --budget 190
    grep -h "prefill\|decode B\|B=" "$LOGS/full43.log" | head -12
else
    for v in 0 1; do
        stage b1_$v 80 env DSV4_MOE_WGMMA=$v python bench/flash_bench.py --layers 43 --experts 64 \
            --prefill "" --decode-batches 1 --ctx 8192 --steps 2
        grep -h "decode B=1" "$LOGS/b1_$v.log" | cut -c1-120
    done
fi
