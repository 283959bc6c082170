#!/usr/bin/env bash
# Written in the twenty-fifth session for the next machine (not run): the start-up warm-up's
# coverage on one GPU.  Run E's short stage never reached serving on a fresh machine (the
# captures and the warm-up compiling for > 255 s), so a first stage only starts the engine (its
# compiles fill Triton's disk cache), then the workloads run on the warm cache with tp_bench's
# own warm-up off: kernels compiled or loaded during each workload are listed (0 = covered).
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS, tp_stage
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
# The 8K engine's warm-up covers most of the short one's kernels (same step budget).
tp_stage prime 320 --concurrency 1 --prompt-len 8192 --output-len 2
tp_stage short 140 --concurrency 1,16 --prompt-len 256 --output-len 16
tp_stage long 120 --concurrency 4 --prompt-len 8192 --output-len 8
grep -h -A12 "warm-up\|^ *c \|rror" "$LOGS"/prime.log "$LOGS"/short.log "$LOGS"/long.log \
    | grep -v "^c=.*host ms" | head -90
