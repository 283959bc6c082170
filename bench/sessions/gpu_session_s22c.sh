#!/usr/bin/env bash
# Twenty-second session, run C: the sparse-attention GPU tests with the 64-head bf16-row plan
# from 128 tokens (test_sparse_attn_gpu's 300-token case now takes it), and the fp8-record
# prefill plans swept at 128-512 tokens (RECORD_WIDE_MIN_T is 1,024: below it unmeasured).
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage tests 90 python -m pytest -q -x tests/kernels/test_gpu_kernels.py -k "sparse_attn"
stage attn_rec 130 python bench/kernels.py --only sparse_attn --sweep \
    --attn-tokens 128,256,512 --attn-sources records --out "$LOGS/attn_rec.json"
tail -n 3 "$LOGS/tests.log"
python - "$LOGS"/attn_rec.json <<'PY'
import json, sys
for f in sys.argv[1:]:
    r = json.load(open(f))
    for sw in r.get("sweeps") or []:
        print(sw["shape"])
        for t, cfg in sorted(sw["tried"], key=lambda x: x[0])[:5]:
            print(f"  {t:9.1f} us  {cfg}")
PY
