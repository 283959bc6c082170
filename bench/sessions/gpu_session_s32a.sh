#!/usr/bin/env bash
# For the thirty-second session (the thirty-first ran out of device time before it):
# 1. the wgmma GPU tests after the early / staged loads' removal (same SASS offline);
# 2. the routing with its picks' weights gathered after the rounds, if its file is there —
#    first make it on this side:  git show <commit>:dsv4/ops/triton_route.py \
#        > bench/sessions/alt_triton_route.py   (cdb06e8, or 5ad2138: docs/PERFORMANCE.md, 31st session)
#    its GPU tests, then the gate launch (bench/gate_parts.py) with each routing, alternating,
#    swapped in on the device's copy of the tree (a 4-layer step cannot resolve ~1 µs a layer);
# 3. what a dependent step costs: kernel boundaries (plain, PDL) against grid barriers in one
#    persistent kernel (bench/grid_sync.py, new: the case for a persistent decode layer);
# 4. where a B=16 / B=64 step goes (4 layers, graph timelines).
# (Never ran: every device start failed until s32b, its short form, got one.)
set -u
cd "$(dirname "$0")/../.."
# the Triton cache comes back in OUT for a later call (carry .tcache)
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
export DSV4_FUSE_Q_NORM=0   # the unverified q_norm fusion only where a stage asks for it
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage gs 60 python bench/grid_sync.py --phases 32 --kb 0,256,2048,8192
grep -h "^|\|programs" "$LOGS/gs.log"
# A fresh machine's Triton cache is empty: the shipped manifest compiled on 14 CPUs first
# (~1-3 s a kernel one after another otherwise, which the stages' limits would not cover).
precompile_stage 200
ALT=bench/sessions/alt_triton_route.py
if [ -f "$ALT" ]; then
    cp dsv4/ops/triton_route.py /tmp/default_triton_route.py
    cp "$ALT" dsv4/ops/triton_route.py
    stage route 90 python -m pytest -q -rf tests/kernels/test_triton_route.py -k gpu
    grep -h "passed\|failed\|FAILED\|Error\|assert" "$LOGS/route.log" | head -10
    for v in alt1 default1 alt2 default2; do
        case $v in alt*) cp "$ALT" dsv4/ops/triton_route.py ;;
                   *) cp /tmp/default_triton_route.py dsv4/ops/triton_route.py ;; esac
        stage "gate_$v" 40 python bench/gate_parts.py --tokens 1,2
        echo "$v:"; grep -h "^| [0-9]" "$LOGS/gate_$v.log"
    done
    cp /tmp/default_triton_route.py dsv4/ops/triton_route.py
fi
# q_norm inside wq_b's GEMV (normed_fp8_linear, new, unverified): its GPU tests, then the
# 4-layer B=1 step with and without it (interleaved graph replays).
stage normed 90 python -m pytest -q -rf tests/kernels/test_normed_fp8_linear.py -k gpu
grep -h "passed\|failed\|FAILED\|Error\|assert" "$LOGS/normed.log" | head -10
stage qab 150 python bench/flash_bench.py --layers 4 --prefill "" --decode-batches 1 \
    --ctx 8192 --steps 2 --launch-ab --ab-variants "pdl;pdl, q_norm in wq_b;pdl, q_norm apart"
grep -h "decode B=1" "$LOGS/qab.log" | head -3
stage tl 120 python bench/flash_bench.py --layers 4 --prefill "" --decode-batches 1,64,16 \
    --ctx 8192 --steps 2 --budget 100 --timeline "$LOGS/tl.txt" --out "$LOGS/tl.json"
grep -h "decode B" "$LOGS/tl.log"
grep -h -A30 "by kernel" "$LOGS/tl.txt" | head -100
cp "$LOGS/tl.txt" "$OUT/tl.txt"
stage tests 120 python -m pytest -q -rf tests/kernels/test_moe_wgmma_gpu.py
grep -h "passed\|failed\|FAILED\|Error\|assert" "$LOGS/tests.log" | head -10
