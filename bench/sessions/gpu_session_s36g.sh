#!/usr/bin/env bash
# Thirty-sixth session: the decode-warpgroup form of the MXFP4 Gluon GEMMs
# (gluon_moe_mxfp4._gemm_mx_dec_kernel: one warpgroup decodes each weight tile into shared
# memory, two consumer warpgroups multiply it against half of the row block each), written
# without a GPU: bits and time against the default plans, 8K and 32K tokens.  The stage's
# limit bounds a hang.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage mxdec 100 python bench/moe_gluon_mx.py --tokens 8192,32768 \
    --plans up:128:4:1:3:ws,down:128:4:1:3,up:128:4:1:3:dec,down:128:4:1:3:dec,down:256:4:1:2:dec,up:128:4:1:4:dec,down:256:4:1:3:dec
