#!/usr/bin/env bash
# Twenty-fifth session, run C: why the engine's TTFT got worse with prefill graphs on (run A:
# 256-token prompt, c=1, 470.6 ms against 218.8 eager).  The same workloads with every step's
# time (--trace) and cProfile tables of each workload's first step (--host-profile), c=1 run
# twice (the second has every kernel compiled), graphs on and off; then the long prompts
# (8K, c=4: run B's TTFT 11.2 s) without prefill graphs for a baseline.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
run_tp() {  # NAME SECS EXTRA...: one engine process, 43 layers
    local name=$1 secs=$2; shift 2
    stage "$name" "$secs" python -m torch.distributed.run --standalone --nproc-per-node 1 \
        bench/tp_bench.py --layers 43 --experts $EXPERTS --graphs --trace \
        --max-num-batched-tokens 2048 --budget $((secs - 20)) --out "$LOGS/$name.json" "$@"
}
run_tp pg 150 --concurrency 1,1,16 --prompt-len 256 --output-len 8 --host-profile "$LOGS/hp_pg.txt"
run_tp eager 110 --concurrency 1,1,16 --prompt-len 256 --output-len 8 --no-prefill-graphs \
    --host-profile "$LOGS/hp_eager.txt"
run_tp long_eager 170 --concurrency 4 --prompt-len 8192 --output-len 8 --no-prefill-graphs
run_tp long_pg 150 --concurrency 4 --prompt-len 8192 --output-len 8
grep -h "TTFT\|^ *1 \|^ *4 \|^ *16 \|rror\|under cProfile" "$LOGS"/pg.log "$LOGS"/eager.log \
    "$LOGS"/long_eager.log "$LOGS"/long_pg.log
