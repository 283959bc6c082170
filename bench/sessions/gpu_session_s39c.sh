#!/usr/bin/env bash
# Thirty-ninth session (~200 s): where the 256-row persistent down GEMM (pdec1) beats the
# plain 128-row default (s39b: -12.7% at 8K tokens, +4.2% at 32K, 256 experts), by token count
# and expert count (rows an expert), and the up GEMM's 256-row persistent chain-1 form.
set -u
cd "$(dirname "$0")/../.."
export TCACHE_MAX_MB=0
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage mx256 110 python bench/moe_gluon_mx.py --tokens 2048,4096,16384 \
    --plans down:128:4:1:4,down:256:4:1:3:pdec1,down:256:4:1:4:pdec1,up:256:4:1:3:pdec1
grep -h "^|" "$LOGS/mx256.log" | grep -v call
stage mx128e 90 python bench/moe_gluon_mx.py --experts 128 --tokens 8192,32768 \
    --plans down:128:4:1:4,down:256:4:1:3:pdec1
grep -h "^|" "$LOGS/mx128e.log" | grep -v call
