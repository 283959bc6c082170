#!/usr/bin/env bash
# For the next session with two H200s (not run yet: the eighth session had one GPU only).
# Programmatic dependent launch under TP/EP, which stays off there unless DSV4_PDL=1: the TP/EP
# graph tests with it forced on (same tokens as one process; NCCL kernels between PDL launches),
# then the full-size V4-Flash at concurrency 1 and 16 with and without it.  If the tests pass
# and c=1 gains, drop the `distributed` exception in dsv4/ops/pdl.py:model_step.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage tp_pdl 200 env DSV4_PDL=1 python -m pytest -q -p no:cacheprovider -x \
    tests/dist/test_tp_graphs_gpu.py
pkill -9 -f "static_child|torch.distributed.run" 2>/dev/null; sleep 2
stage tp_bench_pdl 200 env DSV4_PDL=1 torchrun --nproc-per-node 2 bench/tp_bench.py --layers 43 \
    --ep --graphs --concurrency 1,16 --output-len 64 --budget 170 --out "$LOGS/tp_pdl.json"
pkill -9 -f "torch.distributed.run" 2>/dev/null; sleep 2
stage tp_bench_plain 200 env DSV4_PDL=0 torchrun --nproc-per-node 2 bench/tp_bench.py \
    --layers 43 --ep --graphs --concurrency 1,16 --output-len 64 --budget 170 \
    --out "$LOGS/tp_plain.json"
grep -h "^c=" "$LOGS"/tp_bench_*.log | grep -v " step " | tail -n 12
tar -czf "$OUT/session.tar.gz" -C "$LOGS" .
