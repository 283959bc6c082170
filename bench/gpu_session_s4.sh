#!/usr/bin/env bash
# Fourth session, one H200 (< 7 min): GPU checks of the chunk-wise fp8-record attention, the
# split-K expert kernels and the Triton top-k; their timings; then 4 V4-Flash layers end to end
# on the fp8 cache (the GPU default).
#   bash bench/gpu_session_s4.sh        (logs and JSON packed into $OUT/session.tar.gz)
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_out}"
LOGS="$(mktemp -d)"
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 DSV4_UNVERIFIED_KERNELS=1
stage() {  # stage NAME SECONDS CMD...
    local name=$1 secs=$2; shift 2
    echo "=== $name (limit ${secs}s)"
    local t0=$SECONDS
    timeout "$secs" "$@" > "$LOGS/$name.log" 2>&1
    echo "=== $name: exit $? after $((SECONDS - t0))s"
    tail -n 4 "$LOGS/$name.log"
    tar -czf "$OUT/session.tar.gz" -C "$LOGS" .
}
stage gpu_attn 40 python -m pytest -q -p no:cacheprovider tests/kernels/test_gpu_kernels.py \
    -k "sparse_attn"
stage gpu_moe_topk 80 python -m pytest -q -p no:cacheprovider tests/kernels/test_moe_fast.py \
    $(ls tests/kernels/test_triton_topk.py 2>/dev/null)
stage moe_decode 60 python bench/moe_decode.py --tokens 1,16 --sweep --out "$LOGS/moe.json"
stage attn_bench 60 python bench/kernels.py --only sparse_attn --out "$LOGS/attn.json"
if [ -f bench/topk_bench.py ]; then
    stage topk_bench 35 python bench/topk_bench.py --out "$LOGS/topk.json"
fi
stage flash 110 python bench/flash_bench.py --layers 4 --prefill 8192 --decode-batches 1,16,64 \
    --ctx 8192 --steps 3 --budget 95 --out "$LOGS/flash.json" --profile "$LOGS/profile"
