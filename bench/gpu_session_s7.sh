#!/usr/bin/env bash
# The next session's first two-H200 call (< 5 min), written at the end of the sixth: the GPU
# checks of what changed after its last GPU run — pipelined decode with logprob rows (one GPU
# and TP/EP; the graph-vs-eager tests now unpipelined) and the MXFP4 one-multiply decode after
# its scale-cache merge.
#   bash bench/gpu_session_s7.sh        (logs packed into $OUT/session.tar.gz)
set -u
cd "$(dirname "$0")/.."
source bench/gpu_stages.sh   # OUT, LOGS, stage
CUDA_VISIBLE_DEVICES=0 stage moe_fold 90 python -m pytest -q -p no:cacheprovider \
    tests/kernels/test_moe_fast.py -k fold
CUDA_VISIBLE_DEVICES=0 stage graphs_gpu 90 python -m pytest -q -p no:cacheprovider \
    tests/engine/test_cuda_graphs_gpu.py
stage tp_graphs 240 python -m pytest -q -p no:cacheprovider tests/dist/test_tp_graphs_gpu.py
pkill -9 -f "static_child|torch.distributed.run" 2>/dev/null
tar -czf "$OUT/session.tar.gz" -C "$LOGS" .
