#!/usr/bin/env bash
# Twenty-second session, run C (written for the next machine; not run this session): the
# sparse-attention GPU tests with the 64-head bf16-row plan from 128 tokens (the 300-token case
# of test_sparse_attn_gpu takes it) and the one-loop form of its two sources (new,
# AttnConfig.one_loop: the plan test and the bits against the two loops); the one-loop form
# timed in the bf16-row sweep (512 / 4,096 tokens) and in the 4-layer 2K / 8K prefill
# (DSV4_ATTN_ONE_LOOP=1); the fp8-record prefill plans at 128-512 tokens (RECORD_WIDE_MIN_T
# is 1,024: below it unmeasured); read_records (new: a prefill's dense copy of a record source
# in one launch) on the GPU and the 4-layer 256 / 512 / 2K prefill with and without it.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage tests 100 python -m pytest -q -x tests/kernels/test_gpu_kernels.py -k "sparse_attn"
stage read_records 60 python -m pytest -q -x tests/kernels/test_triton_records.py -k gpu
# read_records (new, UNVERIFIED_ON_GPU): the small prefills with it (the stages' default
# DSV4_UNVERIFIED_KERNELS=1) and without (its twin: ~15 torch ops a dense copy).
stage pre_rr 60 python bench/flash_bench.py --layers 4 --prefill 256,512,2048 \
    --decode-batches "" --reps 3 --budget 50 --out "$LOGS/pre_rr.json"
DSV4_UNVERIFIED_KERNELS=0 stage pre_twin 60 python bench/flash_bench.py --layers 4 \
    --prefill 256,512,2048 --decode-batches "" --reps 3 --budget 50 --out "$LOGS/pre_twin.json"
stage attn_rows 120 python bench/kernels.py --only sparse_attn --sweep \
    --attn-tokens 512,4096 --attn-sources rows --out "$LOGS/attn_rows.json"
stage pre_two 70 python bench/flash_bench.py --layers 4 --prefill 2048,8192 \
    --decode-batches "" --reps 3 --budget 60 --out "$LOGS/pre_two.json"
DSV4_ATTN_ONE_LOOP=1 stage pre_one 70 python bench/flash_bench.py --layers 4 \
    --prefill 2048,8192 --decode-batches "" --reps 3 --budget 60 --out "$LOGS/pre_one.json"
stage attn_rec 130 python bench/kernels.py --only sparse_attn --sweep \
    --attn-tokens 128,256,512 --attn-sources records --out "$LOGS/attn_rec.json"
tail -n 3 "$LOGS/tests.log" "$LOGS/read_records.log"
for p in rr twin; do echo "prefill, dense copies: $p"; grep -h "prefill S=\|Error" "$LOGS/pre_$p.log" | tail -n 3; done
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
