#!/usr/bin/env bash
# Twenty-fifth session, run D: the engine's start-up warm-up (new, on by default on one GPU).
# Runs B / C showed the first requests paying Triton compiles (a first 256-token prompt 3.4 s,
# a mixed step 20.6 s), which also confounded run A's TTFT comparison.  Here tp_bench's own
# warm-up is off (--no-warmup): each workload is the first of its kind after the engine's
# warm-up, and tp_bench counts the Triton kernels compiled or loaded during it (0 = the warm-up
# covered it).  Eager first (a fresh machine: its compiles go into the warm-up), then the
# prefill graphs (TTFT against eager, both compile-free), then 8K prompts.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS, tp_stage
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
tp_stage eager 230 --concurrency 1,16 --prompt-len 256 --output-len 16 --no-prefill-graphs
tp_stage pg 170 --concurrency 1,16 --prompt-len 256 --output-len 16
tp_stage long 150 --concurrency 4 --prompt-len 8192 --output-len 8
grep -h "warm-up\|TTFT\|^ *1 \|^ *4 \|^ *16 \|rror\|compiled or loaded" "$LOGS"/eager.log \
    "$LOGS"/pg.log "$LOGS"/long.log
