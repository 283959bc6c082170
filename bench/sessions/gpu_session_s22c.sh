#!/usr/bin/env bash
# Twenty-second session, run C (written for the next machine; not run this session): the
# sparse-attention GPU tests with the 64-head bf16-row plan from 128 tokens (the 300-token case
# of test_sparse_attn_gpu takes it) and the one-loop form of its two sources (new,
# AttnConfig.one_loop: the plan test and the bits against the two loops); the one-loop form
# timed in the bf16-row sweep (512 / 4,096 tokens) and in the 4-layer 2K / 8K prefill
# (DSV4_ATTN_ONE_LOOP=1); the fp8-record prefill plans at 128-512 tokens (RECORD_WIDE_MIN_T
# is 1,024: below it unmeasured).
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage tests 100 python -m pytest -q -x tests/kernels/test_gpu_kernels.py -k "sparse_attn"
stage attn_rows 120 python bench/kernels.py --only sparse_attn --sweep \
    --attn-tokens 512,4096 --attn-sources rows --out "$LOGS/attn_rows.json"
stage pre_two 70 python bench/flash_bench.py --layers 4 --prefill 2048,8192 \
    --decode-batches "" --reps 3 --budget 60 --out "$LOGS/pre_two.json"
DSV4_ATTN_ONE_LOOP=1 stage pre_one 70 python bench/flash_bench.py --layers 4 \
    --prefill 2048,8192 --decode-batches "" --reps 3 --budget 60 --out "$LOGS/pre_one.json"
stage attn_rec 130 python bench/kernels.py --only sparse_attn --sweep \
    --attn-tokens 128,256,512 --attn-sources records --out "$LOGS/attn_rec.json"
tail -n 3 "$LOGS/tests.log"
for p in two one; do echo "prefill, loops: $p"; grep -h "prefill S=\|Error" "$LOGS/pre_$p.log" | tail -n 3; done
python - "$LOGS"/attn_rows.json "$LOGS"/attn_rec.json <<'PY'
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
