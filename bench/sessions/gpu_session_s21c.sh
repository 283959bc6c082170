#!/usr/bin/env bash
# Twenty-first session, run C (on the warm H100 of run B): the eighteenth session's in-step A/B
# of the three decode plan switches left off (gpu_session_s18g.sh, never run): 4 layers at
# B 1 / 2, interleaved graph replays, each variant's logits against the plain launch's.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
nvidia-smi --query-gpu=name --format=csv,noheader
stage ab 220 python bench/flash_bench.py --layers 4 --prefill "" --decode-batches 1,2 \
    --ctx 8192 --steps 2 --budget 190 --launch-ab \
    --ab-variants "pdl;pdl, wide one-row GEMV plans;pdl, wide one-row bf16w plans;pdl, unsplit short attention" \
    --out "$LOGS/ab.json"
grep -h "decode B\|Error\|median\|variant\|bits\|launch" "$LOGS"/ab.log | tail -n 40
