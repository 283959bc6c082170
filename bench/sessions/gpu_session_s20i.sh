#!/usr/bin/env bash
# Twentieth session, run I: the 64-head sparse-attention plan over fp8 records from 1,024 tokens
# (new default): the attention GPU tests; the prefill plans swept again for bf16 rows and records
# at 1,024 / 4,096 tokens.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage tests 150 python -m pytest -q -x tests/kernels/test_gpu_kernels.py -k "sparse_attn"
stage attn 170 python bench/kernels.py --only sparse_attn --sweep --attn-tokens 1024,4096 \
    --out "$LOGS/attn.json"
tail -n 3 "$LOGS/tests.log"
grep -h "sparse_attn" "$LOGS/attn.log" | head -n 4
python - "$LOGS/attn.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for sw in r.get("sweeps") or []:
    print(sw["shape"])
    for t, cfg in sorted(sw["tried"], key=lambda x: x[0])[:6]:
        print(f"  {t:9.1f} us  {cfg}")
PY
