#!/usr/bin/env bash
# Seventh session, last two-H200 call: prefill 1K/8K with and without the side stream (one GPU
# each, nothing else running), then the full-size V4-Flash on both GPUs (43 layers, EP, graphs,
# pipelined decode) for issue #7's table.
#   bash bench/sessions/gpu_session_s7d.sh        (logs packed into $OUT/session.tar.gz)
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
(CUDA_VISIBLE_DEVICES=0 stage pf_side 100 python bench/flash_bench.py --layers 4 \
    --prefill 1024,8192 --decode-batches 1 --ctx 8192 --steps 3 --budget 80 \
    --out "$LOGS/pf_side.json") &
(CUDA_VISIBLE_DEVICES=1 stage pf_noside 100 env DSV4_SIDE_STREAM=0 python bench/flash_bench.py \
    --layers 4 --prefill 1024,8192 --decode-batches 1 --ctx 8192 --steps 3 --budget 80 \
    --out "$LOGS/pf_noside.json") &
wait
stage tp_bench 230 torchrun --nproc-per-node 2 bench/tp_bench.py --layers 43 --ep --graphs \
    --budget 200 --out "$LOGS/tp_flash.json"
pkill -9 -f "static_child|torch.distributed.run" 2>/dev/null
grep -h "^\[" "$LOGS"/pf_*.log | grep -v "moe\|cache:\|built" | tail -n 12
grep -v "^c=.* step " "$LOGS/tp_bench.log" | tail -n 22
tar -czf "$OUT/session.tar.gz" -C "$LOGS" .
