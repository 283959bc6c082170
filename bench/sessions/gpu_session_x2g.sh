#!/usr/bin/env bash
# Sixth session, two H200s, last call.  In parallel: GPU 0 — the MXFP4 decode-asm GPU tests,
# the expert tile / stage sweep at decode batch sizes, pipelined decode over CUDA graphs on one
# GPU; GPU 1 — 4 V4-Flash layers (8K prefill, decode B 1/16/64/256).  Then on both: pipelined
# graphs under TP/EP (tests), and the full-size V4-Flash (EP, graphs, step channel, pipelined).
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
(
  export CUDA_VISIBLE_DEVICES=0
  stage moe_tests 90 python -m pytest -q -p no:cacheprovider tests/kernels/test_moe_fast.py tests/kernels/test_gpu_kernels.py -k "moe or fold"
  stage moe_sweep 80 python bench/moe_decode.py --tokens 64,16 --sweep \
      --out "$LOGS/moe_sweep.json"
  stage graphs_gpu 80 python -m pytest -q -p no:cacheprovider tests/engine/test_cuda_graphs_gpu.py
) &
(
  export CUDA_VISIBLE_DEVICES=1
  stage flash 230 python bench/flash_bench.py --layers 4 --prefill 8192 \
      --decode-batches 1,16,64,256 --ctx 8192 --steps 3 --budget 200 --out "$LOGS/flash.json"
) &
wait
stage tp_pipe 130 python -m pytest -q -p no:cacheprovider -x tests/dist/test_tp_graphs_gpu.py \
    -k pipelined
pkill -9 -f "static_child|torch.distributed.run" 2>/dev/null; sleep 2
stage tp_bench 210 torchrun --nproc-per-node 2 bench/tp_bench.py --layers 43 --ep --graphs \
    --budget 180 --trace --out "$LOGS/tp_flash.json"
grep -v "^c=.* step " "$LOGS/tp_bench.log" | tail -n 22
tar -czf "$OUT/session.tar.gz" -C "$LOGS" .
