#!/usr/bin/env bash
# Forty-first session, last resort (~270 s, any GPU): the gates-once plan only.  Its GPU bit
# tests, the post + mixes plans at 8K, one 4-layer 8K prefill each of the default and the
# fastest same-bits wide plan.
set -u
cd "$(dirname "$0")/../.."
export TCACHE_MAX_MB=0
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name --format=csv,noheader
stage tests 90 python -m pytest -q -rf tests/kernels/test_hc_fused.py -k "gates or plans_agree"
tail -n 4 "$LOGS/tests.log"
stage sweep 60 python bench/sweep_glue.py --ops hc_post_pre --tokens 8192 --budget 50 \
    --out "$LOGS/sweep.json"
grep -h "^|" "$LOGS/sweep.log"
best=$(python - "$LOGS/sweep.json" <<'PY'
import json, re, sys
rows = [r for r in json.load(open(sys.argv[1]))["rows"] if r.get("T") == 8192 and "us" in r
        and r.get("same") and "BT64 BD16 w4 s3" in r["plan"] and not r["plan"].startswith("default")]
best = min(rows, key=lambda r: r["us"]) if rows else None
if best:
    sm = re.search(r"sm(\d+)", best["plan"]).group(1)
    print(sm + (",g1" if best["plan"].endswith("g1") else ""))
PY
)
echo "fastest same-bits wide plan: ${best:-none}"
for v in base wide; do
    env=""; [ $v = wide ] && env="DSV4_HC_WIDE_PLAN=${best:-4}"
    stage "p4_$v" 55 env $env python bench/flash_bench.py --layers 4 --prefill 8192 \
        --decode-batches "" --reps 3
    grep -h "prefill S=" "$LOGS/p4_$v.log" | tail -n 1
done
