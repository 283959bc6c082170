#!/usr/bin/env bash
# Twenty-eighth session, first call: the GPU tests the twenty-seventh session's last forms have
# not had (the expert kernels' act prep / combine in the up / down kernels, the attention merge
# reading cos / sin in place, the lanes' bits test).
set -u
cd "$(dirname "$0")/../.."
export TCACHE_MAX_MB=0
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS, tp_stage
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage tests 240 python -m pytest -q tests/kernels/test_moe_kchunk_gpu.py \
    tests/kernels/test_gpu_kernels.py::test_sparse_attn_gpu_rope_out tests/model/test_side_stream_gpu.py
grep -h "passed\|failed\|Error" "$LOGS"/tests.log | tail -5
