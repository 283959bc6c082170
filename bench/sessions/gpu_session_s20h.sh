#!/usr/bin/env bash
# Twentieth session, run H: sparse attention's tile plans at prefill (new candidates: 32 heads a
# program, 8 warps; wider / deeper row steps), bf16 rows and fp8 records.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage attn 240 python bench/kernels.py --only sparse_attn --sweep --out "$LOGS/attn.json"
grep -h "sparse_attn" "$LOGS/attn.log" | head -n 12
python - "$LOGS/attn.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for sw in r.get("sweeps") or []:
    if sw["op"] == "sparse_attn" and "T=4096" in sw["shape"]:
        print(sw["shape"])
        for t, cfg in sorted(sw["tried"], key=lambda x: x[0])[:12]:
            print(f"  {t:9.1f} us  {cfg}")
PY
