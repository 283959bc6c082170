#!/usr/bin/env bash
# Twentieth session, run A: the Gluon GEMMs of the predecoded FP8 expert path (new,
# dsv4/ops/gluon_moe_fp8.py): their GPU tests (bits against the Triton kernels), the kernels
# alone against Triton's at an 8K prefill's routing, the whole expert path with and without them.
# The Gluon kernels and bench/gluon_gemm.py were removed after these runs (no gain); they are
# at commit 9fb6c51.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage tests 150 python -m pytest -q -x tests/kernels/test_gluon_moe_fp8_gpu.py
stage gemm 330 python bench/gluon_gemm.py --tokens 8192 --timeout 40
stage path_triton 70 python bench/moe_prefill_fp8.py --tokens 8192
DSV4_FP8MMA_GLUON=1 stage path_gluon 70 python bench/moe_prefill_fp8.py --tokens 8192
tail -n 5 "$LOGS/tests.log"
cat "$LOGS/gemm.log"
for p in triton gluon; do echo "path=$p"; grep -h "|" "$LOGS/path_$p.log" | tail -n 4; done
