#!/usr/bin/env bash
# Ran in the nineteenth session (docs/PERFORMANCE.md); bench/ws_gemm.py and the TMA /
# warp-specialized expert kernels were removed after it: they are at commit 7c14f5f.
# Nineteenth session.  (1) Hopper automatic warp specialization on the block-scaled FP8 expert
# GEMMs (bench/ws_gemm.py: the same grouped GEMM with and without it, up and down forms,
# V4-Flash widths at an 8K prefill's 192 rows an expert).  (2) Why s18g's B=2 PDL step did not
# repeat the plain step's bits (rel 2.2e-2; s18f's did): second captures of plain and PDL,
# replay-to-replay stability, and the variants without the fused MoE launches / lanes.
# (3) The current FP8-MMA expert path at 8K tokens on the same machine (~9.5 min).
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage ws 190 python bench/ws_gemm.py
stage bits 270 python bench/flash_bench.py --layers 4 --prefill "" --decode-batches 2,4,1 \
    --ctx 8192 --steps 2 --budget 250 --launch-ab \
    --ab-variants "pdl;plain, second capture;pdl, second capture;pdl, experts' plan in its own launch;pdl, gate and shared sum unfused;pdl, no comb lane;pdl, no branch lane" \
    --out "$LOGS/bits.json"
stage fp8mma 110 python bench/moe_prefill_fp8.py --tokens 8192
cat "$LOGS/ws.log"
grep -h "decode B" "$LOGS/bits.log" | tail -n 3
grep -h "|" "$LOGS/fp8mma.log" | tail -n 8
