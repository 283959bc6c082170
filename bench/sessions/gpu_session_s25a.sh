#!/usr/bin/env bash
# Written in the twenty-fourth session for the next machine (not run): the engine end to end on
# one GPU with 43 layers — time to first token and TPOT of short prompts with the prefill graphs
# (now the default) and without (bench/tp_bench.py on one process).  gpu_session_s25b.sh has
# the prefill graphs' GPU tests and the long-prompt memory check.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
run_tp() {  # NAME SECS EXTRA...: one engine process, 43 layers, short prompts
    local name=$1 secs=$2; shift 2
    stage "$name" "$secs" python -m torch.distributed.run --standalone --nproc-per-node 1 \
        bench/tp_bench.py --layers 43 --experts $EXPERTS --graphs --concurrency 1,16 \
        --prompt-len 256 --output-len 32 --max-num-batched-tokens 2048 --budget $((secs - 20)) \
        --out "$LOGS/$name.json" "$@"
}
run_tp tp_pg 280
run_tp tp_eager 240 --no-prefill-graphs
grep -h "TTFT\|^ *1 \|^ *16 \|rror" "$LOGS/tp_pg.log" "$LOGS/tp_eager.log"
