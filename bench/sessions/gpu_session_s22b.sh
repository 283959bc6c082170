#!/usr/bin/env bash
# Twenty-second session, run B: the compact C128 carry-over state's GPU checks (its kernels
# against the raw-state kernels and the twin at V4-Flash shapes, graph replays; the model's
# lanes bits test on it), where the 64-head two-stage bf16-row attention plan starts to pay
# (the bf16-row plans swept at 128-512 tokens; the 4-layer prefill of 256 / 512 tokens with the
# plan from 128 tokens against the default 1,024), the prefill attention under Nsight Compute,
# and, last, decode at B=64 with and without the compact state.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage compact 100 python -m pytest -q -x tests/kernels/test_compress_decode.py -k compact
stage lanes 80 python -m pytest -q -x tests/model/test_side_stream_gpu.py
stage attn_small 120 python bench/kernels.py --only sparse_attn --sweep \
    --attn-tokens 128,256,512 --attn-sources rows --out "$LOGS/attn_small.json"
stage pre_small_def 50 python bench/flash_bench.py --layers 4 --prefill 256,512 \
    --decode-batches "" --reps 3 --budget 40 --out "$LOGS/pre_small_def.json"
DSV4_ATTN_DENSE_WIDE_MIN_T=128 stage pre_small_128 50 python bench/flash_bench.py --layers 4 \
    --prefill 256,512 --decode-batches "" --reps 3 --budget 40 --out "$LOGS/pre_small_128.json"
stage ncu_attn 60 env DSV4_PDL=0 ncu --clock-control none -k regex:"_sparse_attn" \
    --launch-skip 2 --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section ComputeWorkloadAnalysis --section WarpStateStats --section Occupancy \
    --metrics regex:"smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
    python bench/ncu_attn.py 4096
stage dec_compact 45 python bench/flash_bench.py --layers 4 --prefill "" --decode-batches 64 \
    --ctx 8192 --steps 2 --budget 40 --out "$LOGS/dec_compact.json"
DSV4_COMPACT_STATE=0 stage dec_raw 45 python bench/flash_bench.py --layers 4 --prefill "" \
    --decode-batches 64 --ctx 8192 --steps 2 --budget 40 --out "$LOGS/dec_raw.json"
tail -n 3 "$LOGS/compact.log" "$LOGS/lanes.log"
for p in pre_small_def pre_small_128; do echo "$p"; grep -h "prefill S=\|Error" "$LOGS/$p.log" | tail -n 3; done
for p in dec_compact dec_raw; do echo "$p"; grep -h "decode B=\|Error" "$LOGS/$p.log" | tail -n 3; done
grep -v "^==" "$LOGS/ncu_attn.log" | grep -v "^ *-* *$" | head -n 120
python - "$LOGS"/attn_small.json <<'PY'
import json, sys
for f in sys.argv[1:]:
    r = json.load(open(f))
    for row in r.get("rows") or []:
        print(f"{row['shape']:<44} {row['us']:9.1f} us  ratio {row['ratio']:.2f}")
    for sw in r.get("sweeps") or []:
        print(sw["shape"])
        for t, cfg in sorted(sw["tried"], key=lambda x: x[0])[:6]:
            print(f"  {t:9.1f} us  {cfg}")
PY
