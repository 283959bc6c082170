#!/usr/bin/env bash
# The thirty-second session's short call (its device starts failed until ~450 s were left):
# s32a's stages by priority, the slowest last — grid_sync; the q_norm-in-wq_b GPU tests; the
# gate launch with each routing (the cdb06e8 form if bench/sessions/alt_triton_route.py is
# there); then the shipped manifest precompiled and the 4-layer B=1 launch A/B of the q_norm
# fusion.  (Afterwards the routing form became dsv4/ops/triton_route.py; the
# q_norm fusion measured slower and was removed — its code and test are at a627247.)
set -u
cd "$(dirname "$0")/../.."
export TCACHE_MAX_MB=0
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
export DSV4_FUSE_Q_NORM=0   # the unverified q_norm fusion only where a stage asks for it
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage gs 45 python bench/grid_sync.py --phases 32 --kb 0,256,2048,8192
grep -h "^|\|programs" "$LOGS/gs.log"
stage normed 60 python -m pytest -q -rf tests/kernels/test_normed_fp8_linear.py -k gpu
grep -h "passed\|failed\|FAILED\|Error\|assert" "$LOGS/normed.log" | head -10
ALT=bench/sessions/alt_triton_route.py
if [ -f "$ALT" ]; then
    cp dsv4/ops/triton_route.py /tmp/default_triton_route.py
    for v in alt1 default1 alt2 default2; do
        case $v in alt*) cp "$ALT" dsv4/ops/triton_route.py ;;
                   *) cp /tmp/default_triton_route.py dsv4/ops/triton_route.py ;; esac
        stage "gate_$v" 30 python bench/gate_parts.py --tokens 1,2
        echo "$v:"; grep -h "^| [0-9]" "$LOGS/gate_$v.log"
    done
    cp "$ALT" dsv4/ops/triton_route.py
    stage route 45 python -m pytest -q -rf tests/kernels/test_triton_route.py -k gpu
    grep -h "passed\|failed\|FAILED\|Error\|assert" "$LOGS/route.log" | head -10
    cp /tmp/default_triton_route.py dsv4/ops/triton_route.py
fi
precompile_stage 120
stage qab 150 python bench/flash_bench.py --layers 4 --prefill "" --decode-batches 1 \
    --ctx 8192 --steps 2 --launch-ab --ab-variants "pdl;pdl, q_norm in wq_b;pdl, q_norm apart"
grep -h "decode B=1" "$LOGS/qab.log" | head -3
