#!/usr/bin/env bash
# The two-GPU session (nvidia-h200-x2, < 7 min): GPU checks of this session's unverified kernel
# paths (chunk-wise fp8-record attention, split-K experts) on GPU 0, then the full-size V4-Flash
# (43 layers, random weights made on the GPUs, EP, CUDA graphs captured at engine start) served
# through the engine at concurrency 1, 16 and 64 (the last one cut by the budget).
#   bash bench/gpu_session_x2.sh         (logs and JSON packed into $OUT/session.tar.gz)
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_out}"
LOGS="$(mktemp -d)"  # packed into one tarball in OUT (the device tool returns at most 8 files)
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv > "$LOGS/gpu.txt" 2>&1
CUDA_VISIBLE_DEVICES=0 timeout 40 python -m pytest -q -p no:cacheprovider \
    tests/kernels/test_gpu_kernels.py -k "sparse_attn" > "$LOGS/gpu_attn.log" 2>&1
echo "gpu attn tests: exit $?"; tail -n 3 "$LOGS/gpu_attn.log"
CUDA_VISIBLE_DEVICES=0 timeout 75 python -m pytest -q -p no:cacheprovider \
    tests/kernels/test_moe_fast.py > "$LOGS/gpu_moe.log" 2>&1
echo "gpu moe tests: exit $?"; tail -n 3 "$LOGS/gpu_moe.log"
tar -czf "$OUT/session.tar.gz" -C "$LOGS" .
# --trace: every step's time (the third session's runs had decode steps of seconds: the lazy
# captures of each new batch bucket, now done at engine start).
timeout 270 torchrun --nproc-per-node 2 bench/tp_bench.py --layers 43 --ep --graphs \
    --budget 240 --trace --out "$LOGS/tp_flash.json" > "$LOGS/tp_bench.log" 2>&1
echo "tp_bench: exit $?"; grep -v "^c=.* step " "$LOGS/tp_bench.log" | tail -n 25
tar -czf "$OUT/session.tar.gz" -C "$LOGS" .
