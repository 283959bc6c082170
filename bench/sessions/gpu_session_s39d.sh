#!/usr/bin/env bash
# Thirty-ninth session (~90 s): the 4-layer 8K prefill's device time by op-table entry, by
# module and by aten op with its shapes (bench/prefill_attrib.py).
set -u
cd "$(dirname "$0")/../.."
export TCACHE_MAX_MB=0
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage attrib 150 python bench/prefill_attrib.py --layers 4 --tokens 8192 --rows 40
grep -v "^\[\|USDT\|STAGE" "$LOGS/attrib.log" | head -n 140
