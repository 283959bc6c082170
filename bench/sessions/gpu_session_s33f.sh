#!/usr/bin/env bash
# Thirty-third session: with the expert GEMMs walking N tiles first (less HBM traffic), does the
# re-encoding of chunk c + 1 beside the GEMMs of chunk c (DSV4_FP8MMA_OVERLAP=1, measured no
# faster in the tenth session) pay now?  The FP8-MMA expert call at 8K / 32K tokens (256
# experts), separate processes alternating; then 43 layers' 8K prefill with and without it; the
# 2K-token tile plans re-swept.
set -u
cd "$(dirname "$0")/../.."
export TCACHE_MAX_MB=0
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
i=0
for v in 0 1 0 1; do
    i=$((i + 1))
    DSV4_FP8MMA_OVERLAP=$v stage "ov${i}_$v" "${OV_SECS:-80}" python bench/moe_order.py \
        --tokens 8192,32768 --paths "FP8-MMA re-encoded" --reps 2
    grep -h "^| [0-9]" "$LOGS/ov${i}_$v.log"
done
[ "${OVERLAP_ONLY:-0}" = 1 ] && exit 0   # gpu_session_s33h.sh: the expert call alone
precompile_stage 70
for v in 1 0; do
    DSV4_FP8MMA_OVERLAP=$v stage "p43_ov$v" 100 python bench/flash_bench.py --layers 43 \
        --experts $EXPERTS --prefill 8192 --decode-batches "" --reps 2
    grep -h "prefill S" "$LOGS/p43_ov$v.log" | tail -n 1
done
# The bf16-MMA tile plans of a 2K chunk re-swept with N tiles first (the plans were chosen
# block-first: twenty-fourth session).
stage sweep2k 120 python bench/moe_decode.py --tokens 2048 --sweep
grep -h "2048" "$LOGS/sweep2k.log" | head -30
