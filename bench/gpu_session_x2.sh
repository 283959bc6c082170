#!/usr/bin/env bash
# The two-GPU half (nvidia-h200-x2, < 10 min): the full-size V4-Flash (43 layers, random weights
# made on the GPUs, EP, CUDA graphs captured at engine start) served through the engine, then the
# TP graphs test.
#   bash bench/gpu_session_x2.sh         (logs and JSON packed into $OUT/session.tar.gz)
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_out}"
LOGS="$(mktemp -d)"  # packed into one tarball in OUT (the device tool returns at most 8 files)
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 DSV4_UNVERIFIED_KERNELS=1
nvidia-smi --query-gpu=name,memory.total --format=csv > "$LOGS/gpu.txt" 2>&1
# --trace: every step's time (the third session's runs had decode steps of seconds: the lazy
# captures of each new batch bucket, now done at engine start).
timeout 390 torchrun --nproc-per-node 2 bench/tp_bench.py --layers 43 --ep --graphs \
    --budget 360 --trace --out "$LOGS/tp_flash.json" > "$LOGS/tp_bench.log" 2>&1
echo "tp_bench: exit $?"; grep -v "^c=.* step " "$LOGS/tp_bench.log" | tail -n 30
tar -czf "$OUT/session.tar.gz" -C "$LOGS" .
timeout 150 python -m pytest -q -x -p no:cacheprovider tests/dist/test_tp_graphs_gpu.py \
    > "$LOGS/tp_graphs_test.log" 2>&1
echo "tp graphs test: exit $?"; tail -n 3 "$LOGS/tp_graphs_test.log"
tar -czf "$OUT/session.tar.gz" -C "$LOGS" .
