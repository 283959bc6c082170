#!/usr/bin/env bash
# Written in the twenty-seventh session, not run (no device time was left; s27c re-recorded the
# manifest instead, and the attention merge's entries were then moved to its final arguments
# offline): the kernel manifest recorded afresh by the two engine workloads of the
# twenty-sixth session (43 layers; 256-token prompts at c=1 / 16, 8K prompts at c=4) into
# $OUT/kernels_sm90.json (copy it over dsv4/ops/kernels_sm90.json; on an H200 the engine runs
# 128 experts a layer), then the 43-layer decode (B 1 / 64) and 2K / 8K prefill with the
# current defaults (the act prep in the up kernel, the RoPE in the attention merge); first the
# GPU tests of this session's last forms.
set -u
cd "$(dirname "$0")/../.."
export TCACHE_MAX_MB=0
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS, tp_stage
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
# The GPU tests this session's last forms have not had: the expert kernels' act prep / combine
# (deselected in s27c by its -k filter) and the merge reading cos / sin in place.
stage tests 150 python -m pytest -q tests/kernels/test_moe_kchunk_gpu.py \
    tests/kernels/test_gpu_kernels.py::test_sparse_attn_gpu_rope_out tests/model/test_side_stream_gpu.py
export DSV4_RECORD_KERNELS="$OUT/kernels_sm90.json"
tp_stage rec_short 150 --concurrency 1,16 --prompt-len 256 --output-len 16
tp_stage rec_long 120 --concurrency 4 --prompt-len 8192 --output-len 8
unset DSV4_RECORD_KERNELS
python -c "import json; d=json.load(open('$OUT/kernels_sm90.json')); print(len(d['kernels']), 'kernels recorded')"
stage full43 260 python bench/flash_bench.py --layers 43 --experts $EXPERTS --prefill 2048,8192 \
    --decode-batches 1,64 --ctx 8192 --steps 2 --reps 2 --budget 245
grep -h "engine\|c=" "$LOGS"/rec_short.log "$LOGS"/rec_long.log | grep -v "host ms" | head -20
grep -h "prefill\|decode B" "$LOGS/full43.log" | head -20
