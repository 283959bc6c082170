#!/usr/bin/env bash
# Twenty-fourth session, run C: the piecewise step with the cache part's token-local inputs made
# in the graphs (Attention.prework) against without, 43 layers; the prefill graphs' GPU tests
# with prework; the device-time table of 128- and 512-token steps (is a short step GPU-bound?).
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage hp_pre 150 python bench/host_profile.py --layers 43 --experts $EXPERTS --tokens 128,512 \
    --reps 5 --top 5 --prefill-graphs 1024
stage hp_nopre 150 python bench/host_profile.py --layers 43 --experts $EXPERTS --tokens 128,512 \
    --reps 5 --top 5 --prefill-graphs 1024 --no-prework
stage prof128 150 python bench/flash_bench.py --layers 43 --experts $EXPERTS --prefill "" \
    --decode-batches "" --ctx 128 --profile "$LOGS/prof128.txt" --out "$LOGS/prof128.json"
stage prof512 150 python bench/flash_bench.py --layers 43 --experts $EXPERTS --prefill "" \
    --decode-batches "" --ctx 512 --profile "$LOGS/prof512.txt" --out "$LOGS/prof512.json"
stage pg_gpu 200 python -m pytest -q tests/engine/test_prefill_graphs.py -k gpu
grep -h "captured\|^## " "$LOGS/hp_pre.log" "$LOGS/hp_nopre.log"
tail -n 3 "$LOGS/pg_gpu.log"
