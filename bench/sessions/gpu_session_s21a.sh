#!/usr/bin/env bash
# Twenty-first session, run A: the prefill sparse-attention plans over bf16 rows swept with the
# 64-head whole-head-dim plans pipelined (2-3 stages, new candidates) at 4,096 / 8,192 tokens;
# then the eighteenth session's in-step A/B of the three plan switches left off
# (gpu_session_s18g.sh, written then and never run).
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
stage attn 200 python bench/kernels.py --only sparse_attn --sweep --attn-tokens 4096,8192 \
    --attn-sources rows --out "$LOGS/attn.json"
python - "$LOGS/attn.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for sw in r.get("sweeps") or []:
    print(sw["shape"])
    for t, cfg in sorted(sw["tried"], key=lambda x: x[0])[:8]:
        print(f"  {t:9.1f} us  {cfg}")
PY
stage ab 230 python bench/flash_bench.py --layers 4 --prefill "" --decode-batches 1,2 \
    --ctx 8192 --steps 2 --budget 210 --launch-ab \
    --ab-variants "pdl;pdl, wide one-row GEMV plans;pdl, wide one-row bf16w plans;pdl, unsplit short attention" \
    --out "$LOGS/ab.json"
grep -h "decode B\|Error\|median\|variant" "$LOGS"/ab.log | tail -n 30
