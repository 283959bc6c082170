#!/usr/bin/env bash
# Seventeenth session, second call (~6 min): the GEMV experts reworked (K-chunk-major stacks,
# inputs quantized once per call, 32-bit activation loads): their GPU tests, bench/moe_gemv.py
# against the MMA kernels at 1 / 2 / 4 tokens, then 4 layers at B 1 / 2 / 4 with the GEMV path
# (its default plan and the sweep's best one-token plan) against the MMA path.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage gputests 170 python -m pytest -q -x tests/kernels/test_moe_gemv.py -k gpu
stage gemv 150 python bench/moe_gemv.py --tokens 1,2,4 --out "$LOGS/gemv.json"
BEST=$(python -c "
import json, re; r = json.load(open('$LOGS/gemv.json'))['tokens']['1']['rows']
ok = {n: v for n, v in r.items() if n.startswith('gemv BN') and 'us' in v}
b = min(ok, key=lambda n: ok[n]['us'])
m = re.match(r'gemv BN (\d+)/(\d+) BK (\d+) s(\d+)/(\d+) w(\d+)', b)
print(','.join(m.groups() + (m.group(6),)))" 2>/dev/null || echo "")
echo "best one-token GEMV plan: $BEST"
stage mma 90 python bench/flash_bench.py --layers 4 --prefill "" --decode-batches 1,2,4 \
    --ctx 8192 --steps 2 --budget 70 --out "$LOGS/mma.json"
DSV4_MOE_GEMV=1 stage gemv_default 90 python bench/flash_bench.py --layers 4 --prefill "" \
    --decode-batches 1,2,4 --ctx 8192 --steps 2 --budget 70 --out "$LOGS/gemv_default.json"
if [ -n "$BEST" ]; then
    DSV4_MOE_GEMV=1 DSV4_GEMV_PLAN=$BEST stage gemv_best 90 python bench/flash_bench.py \
        --layers 4 --prefill "" --decode-batches 1,2,4 --ctx 8192 --steps 2 --budget 70 \
        --out "$LOGS/gemv_best.json"
fi
grep -h "decode B\|moe B\|passed\|failed\|best\|gemv\|mma default" "$LOGS"/*.log | tail -n 60
