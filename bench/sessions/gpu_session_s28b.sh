#!/usr/bin/env bash
# Twenty-eighth session: the Gluon MXFP4 decode GEMM prototype (bench/gluon_fp4_gemv.py) on
# the GPU: its error against a float64 reference and its time against Triton's expert call.
# (As run at 4037e13; bench/gluon_fp4_gemv.py was later rebuilt on dsv4/ops/gluon_moe_decode.py,
# whose kernel replaced the prototype's: the prototype is at f535f33.)
set -u
cd "$(dirname "$0")/../.."
export TCACHE_MAX_MB=0
source bench/sessions/gpu_stages.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage gemv 400 python bench/gluon_fp4_gemv.py --tokens 1,2,4
cat "$LOGS"/gemv.log | grep -v "^\s*$" | tail -60
