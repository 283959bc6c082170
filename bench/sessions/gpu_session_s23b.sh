#!/usr/bin/env bash
# Twenty-third session, run B: what one launch costs the host (bench/launch_cost.py, new), the
# 256-token prefill's cProfile stats saved whole; the rest of gpu_session_s22c.sh: the 4-layer
# 2K / 8K prefill with the one-loop attention (now the default) and without
# (DSV4_ATTN_ONE_LOOP=0), the fp8-record prefill plans at 128-512 tokens.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
lscpu | grep -E "Model name|MHz" | head -3
stage launch 90 python bench/launch_cost.py
stage host 90 python bench/host_profile.py --layers 4 --tokens 256 --top 60 --stats "$LOGS/host.pstats"
stage pre_one 70 python bench/flash_bench.py --layers 4 --prefill 2048,8192 \
    --decode-batches "" --reps 3 --budget 60 --out "$LOGS/pre_one.json"
DSV4_ATTN_ONE_LOOP=0 stage pre_two 70 python bench/flash_bench.py --layers 4 \
    --prefill 2048,8192 --decode-batches "" --reps 3 --budget 60 --out "$LOGS/pre_two.json"
stage attn_rec 130 python bench/kernels.py --only sparse_attn --sweep \
    --attn-tokens 128,256,512 --attn-sources records --out "$LOGS/attn_rec.json"
grep -h "^## prefill" "$LOGS/host.log"
grep -h "^|" "$LOGS/launch.log"
for p in one two; do echo "prefill, loops: $p"; grep -h "prefill S=\|Error" "$LOGS/pre_$p.log" | tail -n 3; done
python - "$LOGS"/attn_rec.json <<'PY'
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
