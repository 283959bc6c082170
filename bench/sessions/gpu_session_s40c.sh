#!/usr/bin/env bash
# Fortieth session's second call (~420 s): the GPU tests of the explicit-FMA post + mixes with
# the gates once (bits against the per-chunk gates) and of the routing plan in chunks of 128
# pairs; bench/prefill_glue.py (the plan's time); the post + mixes plans at 2K / 8K tokens
# (the gates once, about one wave of blocks); the 4-layer 8K prefill with the default wide plan
# and with the fastest same-bits (BT64 BD16 w4 s3) candidate of the sweep (DSV4_HC_WIDE_PLAN).
set -u
cd "$(dirname "$0")/../.."
export TCACHE_MAX_MB=0
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name --format=csv,noheader
stage tests 120 python -m pytest -q -rf tests/kernels/test_hc_fused.py tests/kernels/test_moe_fast.py \
    -k "gates or plans_agree or plan"
tail -n 4 "$LOGS/tests.log"
stage glue 40 python bench/prefill_glue.py --tokens 2048,8192,32768
grep -h "routing plan" "$LOGS/glue.log"
stage sweep 90 python bench/sweep_glue.py --ops hc_post_pre --tokens 2048,8192 --budget 80 \
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
for v in "" "$best" "" "$best"; do
    [ -n "$best" ] || break
    DSV4_HC_WIDE_PLAN="$v" stage "p4_${v:-default}" 75 python bench/flash_bench.py --layers 4 \
        --prefill 8192 --decode-batches "" --reps 3
    grep -h "prefill S=" "$LOGS/p4_${v:-default}.log" | tail -n 1
done
