#!/usr/bin/env bash
# Twenty-third session, run A: where an eager short prefill's host time goes
# (bench/host_profile.py, new: wall / host issue / GPU busy, cProfile tables), then the first
# half of gpu_session_s22c.sh (the attention GPU tests with the 64-head plan from 128 tokens
# and the one-loop form; read_records' GPU test; the 256 / 512 / 2K prefill with and without
# read_records; the bf16-row plans swept with the one-loop candidates).
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage host 90 python bench/host_profile.py --layers 4 --tokens 256,2048 --top 45
stage tests 100 python -m pytest -q -x tests/kernels/test_gpu_kernels.py -k "sparse_attn"
stage read_records 60 python -m pytest -q -x tests/kernels/test_triton_records.py -k gpu
stage pre_rr 60 python bench/flash_bench.py --layers 4 --prefill 256,512,2048 \
    --decode-batches "" --reps 3 --budget 50 --out "$LOGS/pre_rr.json"
DSV4_UNVERIFIED_KERNELS=0 stage pre_twin 60 python bench/flash_bench.py --layers 4 \
    --prefill 256,512,2048 --decode-batches "" --reps 3 --budget 50 --out "$LOGS/pre_twin.json"
stage attn_rows 120 python bench/kernels.py --only sparse_attn --sweep \
    --attn-tokens 512,4096 --attn-sources rows --out "$LOGS/attn_rows.json"
grep -h "^## prefill" "$LOGS/host.log"
tail -n 3 "$LOGS/tests.log" "$LOGS/read_records.log"
for p in rr twin; do echo "prefill, dense copies: $p"; grep -h "prefill S=\|Error" "$LOGS/pre_$p.log" | tail -n 3; done
python - "$LOGS"/attn_rows.json <<'PY'
import json, sys
for f in sys.argv[1:]:
    try:
        r = json.load(open(f))
    except OSError:
        continue
    for sw in r.get("sweeps") or []:
        print(sw["shape"])
        for t, cfg in sorted(sw["tried"], key=lambda x: x[0])[:5]:
            print(f"  {t:9.1f} us  {cfg}")
PY
