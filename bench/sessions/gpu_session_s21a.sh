#!/usr/bin/env bash
# Twenty-first session, run A: the token-tile indexer-scores kernel (new): its GPU tests, the
# indexer scores at prefill layouts (one request, 2K / 8K tokens, fp4 keys) with its plans
# swept, and the 4-layer 8K prefill with it (the default from 256 tokens) and without it
# (DSV4_INDEXER_TILE_MIN_T=0: the one-token kernel); the prefill sparse-attention plans over
# bf16 rows swept with the 64-head whole-head-dim plans pipelined (new candidates) at 4K tokens.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
stage tests 120 python -m pytest -q -x tests/kernels/test_gpu_kernels.py -k "indexer"
stage indexer 150 python bench/kernels.py --only indexer_scores --sweep --out "$LOGS/idx.json"
stage pre_tile 90 python bench/flash_bench.py --layers 4 --prefill 8192 \
    --decode-batches "" --reps 3 --budget 70 --out "$LOGS/pre_tile.json"
DSV4_INDEXER_TILE_MIN_T=0 stage pre_one 90 python bench/flash_bench.py --layers 4 \
    --prefill 8192 --decode-batches "" --reps 3 --budget 70 --out "$LOGS/pre_one.json"
stage attn 130 python bench/kernels.py --only sparse_attn --sweep --attn-tokens 4096 \
    --attn-sources rows --out "$LOGS/attn.json"
tail -n 3 "$LOGS/tests.log"
grep -h "indexer_scores\|sparse_attn" "$LOGS/indexer.log" "$LOGS/attn.log"
for p in tile one; do echo "prefill indexer=$p"; grep -h "prefill S=\|Error" "$LOGS/pre_$p.log" | tail -n 3; done
python - "$LOGS/idx.json" "$LOGS/attn.json" <<'PY'
import json, sys
for path in sys.argv[1:]:
    try:
        r = json.load(open(path))
    except Exception as e:
        print(path, e)
        continue
    for sw in r.get("sweeps") or []:
        print(sw["shape"])
        for t, cfg in sorted(sw["tried"], key=lambda x: x[0])[:8]:
            print(f"  {t:9.1f} us  {cfg}")
PY
