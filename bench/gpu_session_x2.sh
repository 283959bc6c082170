#!/usr/bin/env bash
# The two-GPU half (nvidia-h200-x2, < 10 min): TP graphs test, then the full-size V4-Flash
# (43 layers, random weights made on the GPUs, EP, CUDA graphs) served through the engine.
#   bash bench/gpu_session_x2.sh         (logs and JSON under $OUT, or ./gpu_out)
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_out}"
LOGS="$(mktemp -d)"  # packed into one tarball in OUT (the device tool returns at most 8 files)
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 DSV4_UNVERIFIED_KERNELS=1
nvidia-smi --query-gpu=name,memory.total --format=csv > "$LOGS/gpu.txt" 2>&1
timeout 150 python -m pytest -q -x -p no:cacheprovider tests/dist/test_tp_graphs_gpu.py \
    > "$LOGS/tp_graphs_test.log" 2>&1
echo "tp graphs test: exit $?"; tail -n 3 "$LOGS/tp_graphs_test.log"
# --trace: every step's time (run 3 of the third session had a few decode steps of seconds);
# --profile: torch.profiler tables of 4 decode-only steps per concurrency (they inflate TPOT).
timeout 400 torchrun --nproc-per-node 2 bench/tp_bench.py --layers 43 --ep --graphs \
    --budget 370 --trace --profile "$LOGS/tp_profile.txt" --out "$LOGS/tp_flash.json" \
    > "$LOGS/tp_bench.log" 2>&1
echo "tp_bench: exit $?"; tail -n 30 "$LOGS/tp_bench.log"
tar -czf "$OUT/session.tar.gz" -C "$LOGS" .
