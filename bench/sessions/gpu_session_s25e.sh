#!/usr/bin/env bash
# Twenty-fifth session, run E: the warm-up's phases after run D (which left 26 kernels to the
# c=16 workload: steps of many prompts at the full 2,048-token budget, which a 280-token
# max_model_len kept out of the warm-up, and 12 to the 8K prompts).  Now the warm-up makes
# every step size of several prompts where the model length is short, a mixed step of many
# prefills, and a long prompt to 4x the indexer's top-k span.  tp_bench lists the kernels
# compiled or loaded during each workload.  A fresh machine: the first stage's warm-up
# compiles.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS, tp_stage
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
tp_stage short 270 --concurrency 1,16 --prompt-len 256 --output-len 16
tp_stage long 210 --concurrency 4 --prompt-len 8192 --output-len 8
grep -h -A30 "warm-up\|^ *c \|rror" "$LOGS"/short.log "$LOGS"/long.log | grep -v "^c=.*host ms" | head -80
