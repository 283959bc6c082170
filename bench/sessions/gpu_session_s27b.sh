#!/usr/bin/env bash
# Twenty-seventh session, first call: the 4-layer B=1 graph timeline as run today (where a
# layer's decode goes, kernel by kernel), then the final precompile form on an EMPTY Triton
# cache (gpu_session_s27a.sh: 43 layers, short prompts at c=1 / 16, 8K prompts at c=4,
# recording into a copy of the shipped manifest; the precompile / warm-up GPU tests).
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage tl_pdl 150 python bench/flash_bench.py --layers 4 --prefill "" --decode-batches 1 \
    --ctx 8192 --steps 2 --budget 130 --timeline "$LOGS/tl_pdl.txt" --out "$LOGS/tl_pdl.json"
cp "$OUT/session.tar.gz" "$OUT/timeline.tar.gz"   # s27a re-packs session.tar.gz with its own logs
bash bench/sessions/gpu_session_s27a.sh
