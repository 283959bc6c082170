#!/usr/bin/env bash
# Twenty-first session, run A: the token-tile indexer-scores kernel (new): its GPU tests and
# the indexer scores at prefill layouts (one request, 2K / 8K tokens, fp4 keys) with its plans
# swept; the prefill sparse-attention plans over bf16 rows swept with the 64-head
# whole-head-dim plans pipelined (2-3 stages, new candidates) at 4,096 / 8,192 tokens.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
stage tests 150 python -m pytest -q -x tests/kernels/test_gpu_kernels.py -k "indexer"
stage indexer 170 python bench/kernels.py --only indexer_scores --sweep --out "$LOGS/idx.json"
stage attn 200 python bench/kernels.py --only sparse_attn --sweep --attn-tokens 4096,8192 \
    --attn-sources rows --out "$LOGS/attn.json"
tail -n 3 "$LOGS/tests.log"
grep -h "indexer_scores\|sparse_attn" "$LOGS/indexer.log" "$LOGS/attn.log"
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
