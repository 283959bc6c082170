#!/usr/bin/env bash
# Eighth session, last H200 minutes: attn.wo_a through the grouped FP8 GEMV at 1-2 tokens
# (fp8_grouped_linear): its GPU tests at V4-Flash shapes, then the 4-layer decode at B 1 / 2
# with the launch variants (incl. wo_a on its bf16 weight, cuBLAS) timed in one process.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage t_wo_a 70 python -m pytest -q -p no:cacheprovider tests/kernels/test_fp8_gemv.py -k grouped
stage ab 150 python bench/flash_bench.py --layers 4 --prefill "" --decode-batches 1,2 \
    --ctx 8192 --steps 2 --budget 120 --launch-ab --out "$LOGS/ab.json"
grep -h "^\[" "$LOGS"/ab.log | grep "decode" | tail -n 4
tar -czf "$OUT/session.tar.gz" -C "$LOGS" .
