#!/usr/bin/env bash
# Twenty-fourth session, run E: the mid-size plans (mHC post + mixes on 2 warps from 64 tokens
# and the prefill plan from 256; 64-row expert blocks on two stages): their GPU tests, then in
# one process each the 43-layer piecewise step and the 4-layer eager 2K prefill, new against
# the former plans (DSV4_HC_POST_PRE_MID_T=1024 DSV4_MOE_BM64_STAGES=3).
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage tests 200 python -m pytest -q tests/kernels/test_gpu_kernels.py \
    tests/kernels/test_moe_kchunk_gpu.py -k "hc_ or grouped"
stage hp_new 130 python bench/host_profile.py --layers 43 --experts $EXPERTS --tokens 128,512 \
    --reps 5 --top 3 --prefill-graphs 1024
stage hp_old 100 env DSV4_HC_POST_PRE_MID_T=1024 DSV4_MOE_BM64_STAGES=3 python \
    bench/host_profile.py --layers 43 --experts $EXPERTS --tokens 128,512 --reps 5 --top 3 \
    --prefill-graphs 1024
stage fb_new 80 python bench/flash_bench.py --layers 4 --prefill 512,2048 --decode-batches "" --reps 3
stage fb_old 80 env DSV4_HC_POST_PRE_MID_T=1024 DSV4_MOE_BM64_STAGES=3 python \
    bench/flash_bench.py --layers 4 --prefill 512,2048 --decode-batches "" --reps 3
tail -n 3 "$LOGS/tests.log"
grep -h "captured\|^## " "$LOGS/hp_new.log" "$LOGS/hp_old.log"
grep -h "prefill S=" "$LOGS/fb_new.log" "$LOGS/fb_old.log"
