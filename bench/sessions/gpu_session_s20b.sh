#!/usr/bin/env bash
# Twentieth session, run B: deeper TMA / cp.async pipelines for the predecoded expert GEMMs
# (Triton up 5 stages, down 6; Gluon without the rescale overlap at 5-8 stages) against the
# defaults, at an 8K prefill's routing.
# The Gluon kernels and bench/gluon_gemm.py were removed after these runs (no gain); they are
# at commit 9fb6c51.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage gemm 300 python bench/gluon_gemm.py --tokens 8192 --timeout 40
cat "$LOGS/gemm.log"
