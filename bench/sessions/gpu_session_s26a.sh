#!/usr/bin/env bash
# Written in the twenty-fifth session for the next machine (not run): the start-up warm-up's
# coverage on one GPU.  Run E's short stage never reached serving on a fresh machine (the
# captures and the warm-up compiling for > 255 s), so a first stage only starts the engine (its
# compiles fill Triton's disk cache), then the workloads run on the warm cache with tp_bench's
# own warm-up off: kernels compiled or loaded during each workload are listed (0 = covered).
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
EXPERTS=64
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && EXPERTS=128
run_tp() {  # NAME SECS EXTRA...: one engine process, 43 layers, no tp_bench warm-up
    local name=$1 secs=$2; shift 2
    stage "$name" "$secs" python -m torch.distributed.run --standalone --nproc-per-node 1 \
        bench/tp_bench.py --layers 43 --experts $EXPERTS --graphs --no-warmup \
        --max-num-batched-tokens 2048 --budget $((secs - 15)) --out "$LOGS/$name.json" "$@"
}
# The 8K engine's warm-up covers the short one's kernels too (same step budget).
run_tp prime 320 --concurrency 1 --prompt-len 8192 --output-len 2
run_tp short 140 --concurrency 1,16 --prompt-len 256 --output-len 16
run_tp long 120 --concurrency 4 --prompt-len 8192 --output-len 8
grep -h -A12 "warm-up\|^ *c \|rror" "$LOGS"/prime.log "$LOGS"/short.log "$LOGS"/long.log \
    | grep -v "^c=.*host ms" | head -90
