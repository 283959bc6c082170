#!/usr/bin/env bash
# Twenty-second session, run A: where the 64-head two-stage bf16-row attention plan starts to
# pay (the bf16-row plans swept at 128-512 tokens, CSA shapes; the 4-layer prefill of 256 / 512
# tokens with the plan from 128 tokens against the default 1,024), the 64-head pipelined
# candidates over fp8 records at 256-1,024 tokens (never swept), and on an H200 the 4-layer 8K
# prefill with and without the plan and all 43 layers; last, HCA shapes (64 compressed rows).
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage attn_small 150 python bench/kernels.py --only sparse_attn --sweep \
    --attn-tokens 128,256,512 --attn-sources rows --out "$LOGS/attn_small.json"
stage pre_small_def 60 python bench/flash_bench.py --layers 4 --prefill 256,512 \
    --decode-batches "" --reps 3 --budget 50 --out "$LOGS/pre_small_def.json"
DSV4_ATTN_DENSE_WIDE_MIN_T=128 stage pre_small_128 60 python bench/flash_bench.py --layers 4 \
    --prefill 256,512 --decode-batches "" --reps 3 --budget 50 --out "$LOGS/pre_small_128.json"
stage ncu_attn 90 env DSV4_PDL=0 ncu --clock-control none -k regex:"_sparse_attn" \
    --launch-skip 2 --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section ComputeWorkloadAnalysis --section WarpStateStats --section Occupancy \
    --metrics regex:"smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
    python bench/ncu_attn.py 4096
stage attn_rec 100 python bench/kernels.py --only sparse_attn --sweep \
    --attn-tokens 256,512,1024 --attn-sources records --out "$LOGS/attn_rec.json"
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
grep -v "^==" "$LOGS/ncu_attn.log" | grep -v "^ *-* *$" | head -n 150
for p in small_def small_128 new old; do echo "prefill $p"; grep -h "prefill S=\|Error" "$LOGS/pre_$p.log" 2>/dev/null | tail -n 3; done
echo "43 layers"; grep -h "prefill S=\|Error\|GB" "$LOGS/full43.log" 2>/dev/null | tail -n 4
python - "$LOGS"/attn_*.json <<'PY'
import json, sys
for f in sys.argv[1:]:
    r = json.load(open(f))
    for row in r.get("rows") or []:
        print(f"{row['shape']:<44} {row['us']:9.1f} us  ratio {row['ratio']:.2f}  {row.get('note', '')[:60]}")
    for sw in r.get("sweeps") or []:
        print(sw["shape"])
        for t, cfg in sorted(sw["tried"], key=lambda x: x[0])[:6]:
            print(f"  {t:9.1f} us  {cfg}")
PY
