#!/usr/bin/env bash
# Seventeenth session, first call (~9 min): the re-encoding tiles (GPU byte check, then the
# 8K-token sweep), the 4-layer 8K prefill at the sweep's best tile against the default, and
# all 43 V4-Flash layers (128 routed experts a layer so they fit one H200): decode B 1 / 64 at
# an 8K context and the 8K prefill.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage gputests 150 python -m pytest -q -x tests/kernels/test_moe_fp8mma_gpu.py \
    tests/kernels/test_moe_kchunk_gpu.py
stage tiles 110 python bench/moe_prefill_fp8.py --tokens 8192 --sweep --out "$LOGS/tiles.json"
BEST=$(python -c "
import json; r = json.load(open('$LOGS/tiles.json'))['predecode_by_tile']
print(','.join(map(str, min(r, key=lambda t: t[1])[0])))" 2>/dev/null || echo 32,8)
echo "best re-encoding tile: $BEST"
stage pre_default 80 python bench/flash_bench.py --layers 4 --prefill 8192 \
    --decode-batches "" --reps 3 --budget 60 --out "$LOGS/pre_default.json"
DSV4_FP8MMA_PREDECODE_TILE=$BEST stage pre_best 80 python bench/flash_bench.py --layers 4 \
    --prefill 8192 --decode-batches "" --reps 3 --budget 60 --out "$LOGS/pre_best.json"
DSV4_FP8MMA_PREDECODE_TILE=$BEST stage full43 200 python bench/flash_bench.py --layers 43 \
    --experts 128 --prefill 8192 --decode-batches 1,64 --ctx 8192 --steps 2 --reps 2 \
    --budget 150 --out "$LOGS/full43.json"
grep -h "predecode\|prefill S\|decode B\|model built\|passed\|failed" "$LOGS"/*.log | tail -n 40
