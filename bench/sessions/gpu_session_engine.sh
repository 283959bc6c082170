#!/usr/bin/env bash
# The engine's static-shape decode step against the dynamic one on one H200 (< 6 min), for the
# open question of the third session: in the served full-size model `sparse_attn` took 132 µs
# per call inside the static graph step, 8 µs in flash_bench's dynamic step.  Profiles both
# steps at 8K context with small pools and with pools of a served engine's size.
#   bash bench/sessions/gpu_session_engine.sh      (logs and JSON packed into $OUT/session.tar.gz)
set -u
cd "$(dirname "$0")/../.."
OUT="${OUT:-gpu_out}"
LOGS="$(mktemp -d)"  # packed into one tarball in OUT (the device tool returns at most 8 files)
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
for pages in 0 50000; do
    echo "=== engine_graphs, extra pages $pages"
    timeout 150 python bench/engine_graphs.py --skip-tiny --ctx 8192 --batches 1,16 \
        --extra-pages "$pages" --profile "$LOGS/engine_profile_$pages.txt" \
        --out "$LOGS/engine_graphs_$pages.json" > "$LOGS/engine_graphs_$pages.log" 2>&1
    echo "exit $?"; grep "flash B=" "$LOGS/engine_graphs_$pages.log"
    tar -czf "$OUT/session.tar.gz" -C "$LOGS" .
done
