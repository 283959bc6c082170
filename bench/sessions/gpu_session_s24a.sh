#!/usr/bin/env bash
# Written in the twenty-third session for the next machine (not run): the prefill graphs' GPU
# tests written without a GPU (V4.1 replays against the eager segments) and, on an H200 (43
# layers fit only there, with 128 experts), the capture time and graph memory of all 43 layers
# and the 43-layer prefill at 128 / 512 / 1,024 tokens with and without the graphs — what the
# engine option's default waits for.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage pg_v41 150 python -m pytest -q -x tests/engine/test_prefill_graphs.py -k gpu_v41
# 43 layers with 128 experts a layer (83.9 GB) fit only an H200; an H100 takes 64 (~50 GB): the
# capture cost does not depend on the number of experts, and the step reads 6 a token either way.
{
    stage pg43 240 python bench/flash_bench.py --layers 43 --experts $EXPERTS \
        --prefill 128,512,1024 --decode-batches "" --reps 3 --budget 230 --prefill-graphs 1024 \
        --out "$LOGS/pg43.json"
    stage eager43 150 python bench/flash_bench.py --layers 43 --experts $EXPERTS \
        --prefill 128,512,1024 --decode-batches "" --reps 3 --budget 140 --out "$LOGS/eager43.json"
}
tail -n 3 "$LOGS/pg_v41.log"
for p in pg43 eager43; do [ -f "$LOGS/$p.log" ] && { echo "$p"; grep -h "prefill\|rror" "$LOGS/$p.log" | tail -n 5; }; done
