#!/usr/bin/env bash
# Thirty-sixth session: the MXFP4 Gluon GEMMs (gluon_moe_mxfp4) with 128-row blocks, the serial
# up form and the warp-specialized form (a TMA warp, two consumer warpgroups), at 8K / 16K / 32K.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage mxbench 300 python bench/moe_gluon_mx.py --tokens 8192,16384,32768
