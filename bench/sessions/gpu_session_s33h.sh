#!/usr/bin/env bash
# Thirty-third session, short form of gpu_session_s33f.sh for the device time left: the FP8-MMA
# expert call at 8K / 32K tokens with the re-encoding in order and beside the GEMMs
# (DSV4_FP8MMA_OVERLAP), separate processes alternating.
set -u
cd "$(dirname "$0")/../.."
export TCACHE_MAX_MB=0
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
i=0
for v in 0 1 0 1; do
    i=$((i + 1))
    DSV4_FP8MMA_OVERLAP=$v stage "ov${i}_$v" 60 python bench/moe_order.py --tokens 8192,32768 \
        --paths "FP8-MMA re-encoded" --reps 2
    grep -h "^| [0-9]" "$LOGS/ov${i}_$v.log"
done
