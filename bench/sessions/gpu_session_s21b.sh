#!/usr/bin/env bash
# Twenty-first session, run B: the 64-head, 64-row, two-stage sparse-attention plan for bf16
# rows from 1,024 tokens (new default): the attention GPU tests, the bf16-row prefill plans
# swept at 1K / 8K tokens, the 4-layer prefill (2K / 8K) with it and without it
# (DSV4_ATTN_DENSE_WIDE_MIN_T=10^9: the 16-head plan), all 43 V4-Flash layers at 8K with it.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage tests 100 python -m pytest -q -x tests/kernels/test_gpu_kernels.py -k "sparse_attn"
stage attn 100 python bench/kernels.py --only sparse_attn --sweep --attn-tokens 1024,8192 \
    --attn-sources rows --out "$LOGS/attn.json"
stage pre_new 80 python bench/flash_bench.py --layers 4 --prefill 2048,8192 \
    --decode-batches "" --reps 3 --budget 60 --out "$LOGS/pre_new.json"
DSV4_ATTN_DENSE_WIDE_MIN_T=1000000000 stage pre_old 80 python bench/flash_bench.py --layers 4 \
    --prefill 2048,8192 --decode-batches "" --reps 3 --budget 60 --out "$LOGS/pre_old.json"
# (83.9 GB of weights: on an H200 only)
if [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n1)" -gt 100000 ]; then
    stage full43 200 python bench/flash_bench.py --layers 43 --experts 128 --prefill 8192 \
        --decode-batches "" --reps 2 --budget 170 --out "$LOGS/full43.json"
fi
tail -n 3 "$LOGS/tests.log"
grep -h "sparse_attn" "$LOGS/attn.log"
for p in new old; do echo "prefill plan=$p"; grep -h "prefill S=\|Error" "$LOGS/pre_$p.log" | tail -n 3; done
echo "43 layers"; grep -h "prefill S=\|Error\|GB" "$LOGS/full43.log" 2>/dev/null | tail -n 4
python - "$LOGS/attn.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for sw in r.get("sweeps") or []:
    print(sw["shape"])
    for t, cfg in sorted(sw["tried"], key=lambda x: x[0])[:5]:
        print(f"  {t:9.1f} us  {cfg}")
PY
