#!/usr/bin/env bash
# The seventh session's first two-H200 call (< 6 min): the GPU checks of what changed after the
# sixth session's last GPU run — pipelined decode with logprob rows (one GPU and TP/EP; the
# graph-vs-eager tests now unpipelined) and the MXFP4 one-multiply decode after its scale-cache
# merge — while GPU 1 records the kernel timeline of the 4-layer decode graph at B=1 and 64.
#   bash bench/sessions/gpu_session_s7.sh        (logs packed into $OUT/session.tar.gz)
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
(CUDA_VISIBLE_DEVICES=1 timeout 200 python bench/flash_bench.py --layers 4 --prefill "" \
    --decode-batches 1,64 --ctx 8192 --steps 3 --budget 150 --timeline "$LOGS/timeline.txt" \
    --out "$LOGS/flash.json" > "$LOGS/flash.log" 2>&1) &
CUDA_VISIBLE_DEVICES=0 stage moe_fold 90 python -m pytest -q -p no:cacheprovider \
    tests/kernels/test_moe_fast.py -k fold
CUDA_VISIBLE_DEVICES=0 stage graphs_gpu 90 python -m pytest -q -p no:cacheprovider \
    tests/engine/test_cuda_graphs_gpu.py
wait
grep "^\[" "$LOGS/flash.log" | tail -n 8
head -c 1500 "$LOGS/timeline.txt"
stage tp_graphs 240 python -m pytest -q -p no:cacheprovider tests/dist/test_tp_graphs_gpu.py
pkill -9 -f "static_child|torch.distributed.run" 2>/dev/null
tar -czf "$OUT/session.tar.gz" -C "$LOGS" .
