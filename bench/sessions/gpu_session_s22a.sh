#!/usr/bin/env bash
# Twenty-second session, run A (written for an H200; never got one): the 4-layer 8K prefill
# with and without the twenty-first session's 64-head bf16-row attention plan, all 43 layers at
# 8K, and the bf16-row plans swept at HCA shapes (64 compressed rows).  The threshold sweep and
# the Nsight Compute profile this script first held ran on an H100 in run B (s22b); the fp8-record
# sweep below 1,024 tokens is in s22c.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n1)" -gt 100000 ]; then
    stage pre_new 70 python bench/flash_bench.py --layers 4 --prefill 8192 \
        --decode-batches "" --reps 3 --budget 60 --out "$LOGS/pre_new.json"
    DSV4_ATTN_DENSE_WIDE_MIN_T=1000000000 stage pre_old 70 python bench/flash_bench.py \
        --layers 4 --prefill 8192 --decode-batches "" --reps 3 --budget 60 \
        --out "$LOGS/pre_old.json"
    stage full43 170 python bench/flash_bench.py --layers 43 --experts 128 --prefill 8192 \
        --decode-batches "" --reps 2 --budget 150 --out "$LOGS/full43.json"
fi
stage attn_hca 70 python bench/kernels.py --only sparse_attn --sweep --attn-kb 64 \
    --attn-tokens 1024,8192 --attn-sources rows --out "$LOGS/attn_hca.json"
for p in new old; do echo "prefill $p"; grep -h "prefill S=\|Error" "$LOGS/pre_$p.log" 2>/dev/null | tail -n 3; done
echo "43 layers"; grep -h "prefill S=\|Error\|GB" "$LOGS/full43.log" 2>/dev/null | tail -n 4
python - "$LOGS"/attn_hca.json <<'PY'
import json, sys
for f in sys.argv[1:]:
    r = json.load(open(f))
    for sw in r.get("sweeps") or []:
        print(sw["shape"])
        for t, cfg in sorted(sw["tried"], key=lambda x: x[0])[:6]:
            print(f"  {t:9.1f} us  {cfg}")
PY
